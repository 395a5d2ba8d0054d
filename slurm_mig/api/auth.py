"""Request authentication for the node-to-controller channel.

Two schemes, one interface (``sign(body) -> header`` on the node,
``verify(header, body) -> Principal`` on the controller):

* ``munge``: the node runs ``munge`` with a digest of the request body as the
  credential payload; the controller runs ``unmunge`` and learns the sender's
  UID/GID and host from munged itself. munged rejects expired (TTL) and
  replayed credentials; we also keep our own replay cache, because a cluster
  may run several controllers' worth of munged instances.
* ``hmac``: HMAC-SHA256 over timestamp, nonce and body digest with a key
  file readable only by root, for sites and tests without MUNGE.

Neither scheme ever builds a shell string: munge/unmunge get an argv list and
their input on stdin.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import stat
import subprocess
import threading
import time
from dataclasses import dataclass

from slurm_mig.errors import SlurmMigError

HEADER = "X-Slurm-Mig-Auth"
#: The controller's signature on its answer, bound to the request it answers (see _response_digest).
RESPONSE_HEADER = "X-Slurm-Mig-Response-Auth"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class AuthError(SlurmMigError):
    """A request's credential is missing, forged, expired, replayed or from a user not allowed."""

    exit_code = 4


@dataclass(frozen=True)
class Principal:
    """Who a verified request came from."""

    uid: int
    gid: int
    host: str  # as the credential says (munge: the encoding host; hmac: the claimed node)
    scheme: str


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _response_digest(request_header: str, status: int, body: bytes) -> str:
    """What a response signature covers: the request's credential (so an answer cannot be replayed
    to another request), the HTTP status and the body."""
    msg = "\n".join(["slurm-mig/1 response", _digest(request_header.encode()), str(int(status)), _digest(body)])
    return _digest(msg.encode())


class ReplayCache:
    """Remembers credential ids until they expire; a second sighting is a replay."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def check_and_add(self, key: str, now: float) -> None:
        with self._lock:
            if len(self._seen) > 10_000:
                cutoff = now - self.window_s
                self._seen = {k: t for k, t in self._seen.items() if t >= cutoff}
            if key in self._seen:
                raise AuthError("replayed request credential")
            self._seen[key] = now


# -- MUNGE -----------------------------------------------------------------

# munge.h's munge_err_t values that unmunge returns for a bad credential.
_MUNGE_STATUS = {
    6: "cannot reach munged (socket)",
    8: "invalid credential (bad format or key)",
    9: "invalid credential (bad format or key)",
    10: "invalid credential (bad format or key)",
    11: "invalid credential (bad format or key)",
    12: "invalid credential (bad format or key)",
    13: "invalid credential (bad format or key)",
    14: "invalid credential (bad format or key)",
    15: "expired credential",
    16: "credential from the future (clock rewound)",
    17: "replayed credential",
    18: "unauthorized credential",
}

class MungeAuth:
    """MUNGE credentials via the munge/unmunge commands."""

    scheme = "munge"

    def __init__(self, socket: str | None = None, *, allowed_uids: tuple[int, ...] = (0,),
                 ttl_s: int = 60, timeout_s: float = 5.0, munge_bin: str = "munge", unmunge_bin: str = "unmunge"):
        self.socket = socket
        self.allowed_uids = allowed_uids
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.munge_bin = munge_bin
        self.unmunge_bin = unmunge_bin
        self.replay = ReplayCache(window_s=max(ttl_s * 2, 60))

    def _argv(self, binary: str) -> list[str]:
        argv = [binary]
        if self.socket:
            argv += ["--socket", self.socket]
        return argv

    def sign(self, body: bytes, node: str = "") -> str:
        """A header value carrying a fresh MUNGE credential bound to ``body``."""
        payload = f"slurm-mig/1 {_digest(body)} {node}".encode()
        argv = self._argv(self.munge_bin) + ["--ttl", str(self.ttl_s)]
        try:
            out = subprocess.run(argv, input=payload, capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(f"cannot create a MUNGE credential: {exc}") from exc
        if out.returncode != 0:
            raise AuthError(f"munge failed: {out.stderr.decode(errors='replace').strip()}")
        return "munge " + out.stdout.decode().strip()

    def verify(self, header: str, body: bytes, now: float | None = None) -> Principal:
        """Decode the credential with unmunge and check it covers ``body`` and an allowed user."""
        scheme, _, cred = (header or "").partition(" ")
        if scheme != "munge" or not cred.startswith("MUNGE:"):
            raise AuthError("request has no MUNGE credential")
        argv = self._argv(self.unmunge_bin) + ["--numeric"]
        try:
            out = subprocess.run(argv, input=cred.encode(), capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(f"cannot check the MUNGE credential: {exc}") from exc
        if out.returncode != 0:
            # With --numeric, unmunge reports why only as its exit status.
            why = _MUNGE_STATUS.get(out.returncode) or out.stderr.decode(errors="replace").strip()
            raise AuthError(f"MUNGE credential rejected: {why or f'status {out.returncode}'}")
        meta_text, _, payload = out.stdout.partition(b"\n\n")
        meta = {}
        for line in meta_text.decode(errors="replace").splitlines():
            key, _, value = line.partition(":")
            meta[key.strip()] = value.strip()
        try:
            uid = int(meta["UID"].split()[0])
            gid = int(meta["GID"].split()[0])
        except (KeyError, ValueError, IndexError) as exc:
            raise AuthError("unmunge output lacks UID/GID") from exc
        fields = payload.decode(errors="replace").rstrip("\n").split(" ")
        if len(fields) < 2 or fields[0] != "slurm-mig/1" or not _HEX64.fullmatch(fields[1]) \
                or not hmac.compare_digest(fields[1], _digest(body)):
            raise AuthError("MUNGE credential does not cover this request body")
        if uid not in self.allowed_uids:
            raise AuthError(f"requests from uid {uid} are not allowed (allowed: {list(self.allowed_uids)})")
        self.replay.check_and_add(hashlib.sha256(cred.encode()).hexdigest(), time.time() if now is None else now)
        host = meta.get("ENCODE_HOST", "")
        return Principal(uid, gid, host, "munge")


    def sign_response(self, request_header: str, status: int, body: bytes) -> str:
        """The controller's credential for its answer (a fresh MUNGE credential over the answer)."""
        payload = f"slurm-mig/1-response {_response_digest(request_header, status, body)}".encode()
        argv = self._argv(self.munge_bin) + ["--ttl", str(self.ttl_s)]
        try:
            out = subprocess.run(argv, input=payload, capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(f"cannot create a MUNGE credential: {exc}") from exc
        if out.returncode != 0:
            raise AuthError(f"munge failed: {out.stderr.decode(errors='replace').strip()}")
        return "munge " + out.stdout.decode().strip()

    def verify_response(self, request_header: str, status: int, header: str | None, body: bytes) -> None:
        """Check the answer came from an allowed uid (root: the controller) and covers this request,
        status and body; munged refuses a replayed credential. Raises AuthError."""
        scheme, _, cred = (header or "").partition(" ")
        if scheme != "munge" or not cred.startswith("MUNGE:"):
            raise AuthError("answer has no MUNGE credential")
        argv = self._argv(self.unmunge_bin) + ["--numeric"]
        try:
            out = subprocess.run(argv, input=cred.encode(), capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(f"cannot check the answer's MUNGE credential: {exc}") from exc
        if out.returncode != 0:
            why = _MUNGE_STATUS.get(out.returncode) or out.stderr.decode(errors="replace").strip()
            raise AuthError(f"answer's MUNGE credential rejected: {why or f'status {out.returncode}'}")
        meta_text, _, payload = out.stdout.partition(b"\n\n")
        uid = None
        for line in meta_text.decode(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "UID":
                try:
                    uid = int(value.split()[0])
                except (ValueError, IndexError):
                    uid = None
        if uid not in self.allowed_uids:
            raise AuthError(f"answer signed by uid {uid}, not by the controller")
        want = f"slurm-mig/1-response {_response_digest(request_header, status, body)}"
        if not hmac.compare_digest(payload.decode(errors="replace").rstrip("\n").encode(), want.encode()):
            raise AuthError("answer's MUNGE credential does not cover this answer")


# -- HMAC ------------------------------------------------------------------

def load_key(path: str) -> bytes:
    """Read a shared key file, refusing one that other users can read or write."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise AuthError(f"cannot read auth key file {path}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise AuthError(f"auth key file {path} is a symlink; refusing it")
    if st.st_mode & 0o077:
        raise AuthError(f"auth key file {path} has mode {oct(st.st_mode & 0o777)}; it must be 0600")
    with open(path, "rb") as fh:
        key = fh.read().strip()
    if len(key) < 32:
        raise AuthError(f"auth key file {path} holds {len(key)} bytes; at least 32 are needed")
    return key


def create_key(path: str) -> None:
    """Write a new random key file with mode 0600 (never overwrites)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")


class HmacAuth:
    """HMAC-SHA256 request signatures with a shared key, a clock-skew limit and a nonce cache."""

    scheme = "hmac"

    def __init__(self, key: bytes, *, max_skew_s: float = 60.0, uid: int = 0):
        self.key = key
        self.max_skew_s = max_skew_s
        self.uid = uid
        self.replay = ReplayCache(window_s=2 * max_skew_s)

    def _mac(self, ts: str, nonce: str, node: str, body: bytes) -> str:
        msg = "\n".join(["slurm-mig/1", ts, nonce, node, _digest(body)]).encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def sign(self, body: bytes, node: str = "", now: float | None = None) -> str:
        ts = f"{time.time() if now is None else now:.3f}"
        nonce = secrets.token_hex(16)
        return f"hmac {ts} {nonce} {node} {self._mac(ts, nonce, node, body)}"

    def verify(self, header: str, body: bytes, now: float | None = None) -> Principal:
        parts = (header or "").split(" ")
        if len(parts) != 5 or parts[0] != "hmac":
            raise AuthError("request has no HMAC credential")
        _, ts, nonce, node, mac = parts
        # compare_digest takes ASCII only (TypeError otherwise): a MAC is 64 hex digits, anything else is forged.
        if not _HEX64.fullmatch(mac) or not hmac.compare_digest(mac, self._mac(ts, nonce, node, body)):
            raise AuthError("request signature does not match (wrong key or altered request)")
        now = time.time() if now is None else now
        try:
            skew = abs(now - float(ts))
        except ValueError as exc:
            raise AuthError("request timestamp is not a number") from exc
        if not math.isfinite(skew) or skew > self.max_skew_s:  # "nan" would pass a plain comparison forever
            raise AuthError(f"request timestamp is {skew:.0f} s off (limit {self.max_skew_s:.0f} s): expired or clock skew")
        self.replay.check_and_add(nonce, now)
        return Principal(self.uid, self.uid, node, "hmac")


    def sign_response(self, request_header: str, status: int, body: bytes) -> str:
        """The controller's MAC over its answer, bound to the request's credential."""
        return "hmac " + hmac.new(self.key, _response_digest(request_header, status, body).encode(),
                                  hashlib.sha256).hexdigest()

    def verify_response(self, request_header: str, status: int, header: str | None, body: bytes) -> None:
        """Check the answer's MAC (the key, this request, this status and body). Raises AuthError."""
        scheme, _, mac = (header or "").partition(" ")
        if scheme != "hmac" or not _HEX64.fullmatch(mac):
            raise AuthError("answer has no HMAC signature")
        want = hmac.new(self.key, _response_digest(request_header, status, body).encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, want):
            raise AuthError("answer's signature does not match (wrong key, altered or replayed answer)")


def auth_from_settings(method: str, *, munge_socket: str | None = None, key_file: str | None = None,
                       max_skew_s: float = 60.0, allowed_uids: tuple[int, ...] = (0,)):
    """Build the authenticator a config names ("munge" or "hmac")."""
    if method == "munge":
        return MungeAuth(munge_socket, allowed_uids=allowed_uids, ttl_s=int(max(max_skew_s, 10)))
    if method == "hmac":
        if not key_file:
            raise AuthError("auth method hmac needs a key_file")
        return HmacAuth(load_key(key_file), max_skew_s=max_skew_s)
    raise AuthError(f"unknown auth method {method!r} (expected 'munge' or 'hmac')")
