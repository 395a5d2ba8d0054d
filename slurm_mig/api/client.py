"""The node side of the channel: signed JSON POSTs to the controller (stdlib only, fast import)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

from slurm_mig.api.auth import HEADER, RESPONSE_HEADER, AuthError
from slurm_mig.errors import SlurmMigError


_DIRECT: urllib.request.OpenerDirector | None = None


def direct_opener() -> urllib.request.OpenerDirector:
    """The one opener for every request to the controller: straight to its address, never through
    $http_proxy/$https_proxy (urlopen honours them, $no_proxy aside, even for 127.0.0.1). Sites set a proxy
    system-wide (/etc/environment) that slurmd and its Prolog/Epilog inherit; a proxy cannot reach the head
    node's API (the hooks would take their fallback) and would see every signed request and its answer."""
    global _DIRECT
    if _DIRECT is None:
        _DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return _DIRECT


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

    def __init__(self, url: str, auth, node: str, timeout_s: float = 5.0, retries: int = 1,
                 verify_responses: bool = True):
        self.url = url.rstrip("/")
        self.auth = auth
        self.node = node
        self.timeout_s = timeout_s
        self.retries = retries
        # The controller signs every answer to a signed request, bound to that request. An answer that
        # does not verify (forged or altered in the middle, replayed, or from a controller that could
        # not sign) is treated as no answer: the node takes its fallback, it never acts on it.
        self.verify_responses = verify_responses and hasattr(auth, "verify_response")

    def _check(self, path: str, request_header: str, status: int, headers, body: bytes) -> None:
        if not self.verify_responses:
            return
        try:
            self.auth.verify_response(request_header, status, headers.get(RESPONSE_HEADER), body)
        except AuthError as exc:
            try:
                said = (json.loads(body or b"{}") or {}).get("error") if status != 200 else None
            except (ValueError, AttributeError):
                said = None
            extra = f"; it said: {str(said)[:200]}" if said else ""
            raise ControllerUnavailable(f"answer {status} to {path} not authenticated ({exc}), "
                                        f"ignored{extra}") from None

    def call(self, path: str, payload: dict) -> dict:
        """POST ``payload`` to ``path``; retry once on a connection failure (a fresh credential each time)."""
        body = json.dumps(payload, sort_keys=True).encode()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url + path, data=body, method="POST")
            req.add_header("Content-Type", "application/json")
            try:
                signed = self.auth.sign(body, self.node, path=path)
            except SlurmMigError as exc:
                # No credential (munged down): as good as no controller, so callers take their fallback.
                raise ControllerUnavailable(f"cannot sign the request: {exc}") from exc
            req.add_header(HEADER, signed)
            try:
                status, headers, answer = self._post(req)
                self._check(path, signed, status, headers, answer)
            except ControllerUnavailable as exc:
                last = exc
            else:
                if status == 200:
                    try:
                        return json.loads(answer or b"{}")
                    except ValueError as exc:
                        last = ControllerUnavailable(f"controller answered {path} with malformed JSON: {exc}")
                else:
                    try:
                        detail = json.loads(answer or b"{}")
                        detail = detail if isinstance(detail, dict) else {}
                    except ValueError:
                        detail = {}
                    message = detail.get("error") or f"HTTP {status}"
                    if status >= 500:
                        last = ControllerUnavailable(f"controller error {status} on {path}: {message}")
                    else:
                        raise ControllerRefused(f"controller refused {path}: {message}", status,
                                                detail.get("kind", ""))
            if attempt < self.retries:
                time.sleep(0.2 * (attempt + 1))
        assert last is not None
        raise last

    def _post(self, req) -> tuple[int, object, bytes]:
        """(status, headers, body) of one request; ControllerUnavailable when there is no answer."""
        try:
            with direct_opener().open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, exc.headers, exc.read()
            except (OSError, http.client.HTTPException) as err:
                raise ControllerUnavailable(f"controller at {self.url}: answer {exc.code} cut short: {err}") from None
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            raise ControllerUnavailable(f"controller at {self.url} unreachable: {getattr(exc, 'reason', exc)}") from None
        except http.client.HTTPException as exc:
            # Cut short (IncompleteRead: a controller killed mid-answer) or not HTTP at all (BadStatusLine,
            # LineTooLong: another service on the port); the bytes it sent are shown escaped and cut.
            raise ControllerUnavailable(f"controller at {self.url} unreachable: no HTTP answer "
                                        f"({type(exc).__name__}: {ascii(str(exc))[:200]})") from None
