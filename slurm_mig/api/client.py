"""The node side of the channel: signed JSON POSTs to the controller (stdlib only, fast import)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from slurm_mig.api.auth import HEADER
from slurm_mig.errors import SlurmMigError


class ControllerUnavailable(SlurmMigError):
    """The controller did not answer (down, slow, unreachable, or answered 5xx)."""


class ControllerRefused(SlurmMigError):
    """The controller answered and refused the request (auth failure or a 4xx with a reason)."""

    def __init__(self, message: str, status: int, kind: str = ""):
        super().__init__(message)
        self.status = status
        self.kind = kind


class ControllerClient:
    """Calls the controller on behalf of one node."""

    def __init__(self, url: str, auth, node: str, timeout_s: float = 5.0, retries: int = 1):
        self.url = url.rstrip("/")
        self.auth = auth
        self.node = node
        self.timeout_s = timeout_s
        self.retries = retries

    def call(self, path: str, payload: dict) -> dict:
        """POST ``payload`` to ``path``; retry once on a connection failure (a fresh credential each time)."""
        body = json.dumps(payload, sort_keys=True).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url + path, data=body, method="POST")
            req.add_header("Content-Type", "application/json")
            try:
                req.add_header(HEADER, self.auth.sign(body, self.node))
            except SlurmMigError as exc:
                # No credential (munged down): as good as no controller, so callers take their fallback.
                raise ControllerUnavailable(f"cannot sign the request: {exc}") from exc
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as exc:
                try:
                    detail = json.loads(exc.read() or b"{}")
                except ValueError:
                    detail = {}
                message = detail.get("error") or exc.reason
                if exc.code >= 500:
                    last = ControllerUnavailable(f"controller error {exc.code} on {path}: {message}")
                else:
                    raise ControllerRefused(f"controller refused {path}: {message}", exc.code,
                                            detail.get("kind", "")) from None
            except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
                last = ControllerUnavailable(f"controller at {self.url} unreachable: {getattr(exc, 'reason', exc)}")
            if attempt < self.retries:
                time.sleep(0.2 * (attempt + 1))
        assert last is not None
        raise last
