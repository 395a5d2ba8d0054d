"""Request authentication for the node-to-controller channel.

Two schemes, one interface (``sign(body) -> header`` on the node,
``verify(header, body) -> Principal`` on the controller):

* ``munge``: the node encodes a MUNGE credential (libmunge in-process, or the
  ``munge`` command where the library is missing) with a digest of the request
  body as the payload; the controller decodes it and learns the sender's
  UID/GID and host from munged itself. munged rejects expired (TTL) and
  replayed credentials; we also keep our own replay cache, because a cluster
  may run several controllers' worth of munged instances.
* ``hmac``: HMAC-SHA256 over timestamp, nonce, node, route and body digest with
  a key file readable only by root, for sites and tests without MUNGE.

Both credentials cover the route (``POST <path>``) as well as the body: one that
covered the body alone could be delivered by a machine in the middle to another
route that accepts the same fields (a node's /v1/bound turned into a
/v1/bind-failed, which releases a running job's binding).

Neither scheme ever builds a shell string: munge/unmunge get an argv list and
their input on stdin.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import hashlib
import hmac
import logging
import math
import os
import re
import secrets
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass

from slurm_mig.api.loglimit import LogLimiter
from slurm_mig.errors import SlurmMigError

log = logging.getLogger("slurm_mig.api.auth")

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


#: The version tag of a request credential; /2 covers the route (/1 did not, and is refused).
_REQUEST_TAG = "slurm-mig/2"


def _route(path: str) -> str:
    """What a credential says about the request line: only POSTs are signed."""
    return f"POST {path}"


def _response_digest(request_header: str, status: int, body: bytes) -> str:
    """What a response signature covers: the request's credential (so an answer cannot be replayed
    to another request), the HTTP status and the body."""
    msg = "\n".join(["slurm-mig/1 response", _digest(request_header.encode()), str(int(status)), _digest(body)])
    return _digest(msg.encode())


class ReplayCache:
    """Remembers credential ids until they expire; a second sighting is a replay.

    Kept in the order they were seen, so each call forgets the expired ones from the front, in time
    proportional to how many expired. (It used to copy every id still in the window at each call once
    it held over 10,000: at a few hundred requests a second, with the default 300 s window, each request
    then spent milliseconds under the lock, and the controller's throughput fell with its load.) An id
    seen later under an earlier clock (a step back) waits behind the newer ones, kept longer, never less.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def check_and_add(self, key: str, now: float) -> None:
        with self._lock:
            cutoff = now - self.window_s
            seen = self._seen
            while seen and seen[next(iter(seen))] < cutoff:
                seen.popitem(last=False)
            if key in seen:
                raise AuthError("replayed request credential")
            seen[key] = now


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

class _LibMunge:
    """libmunge called in-process through ctypes: no fork and exec of munge/unmunge per credential,
    which dominated the controller's cost per request under load (docs/reliability.md, load).

    A context per call (libmunge contexts are not thread-safe). ``load`` gives None where the
    library cannot be loaded; MungeAuth then runs the commands.
    """

    OPT_TTL, OPT_ADDR4, OPT_SOCKET = 4, 5, 8  # munge.h's munge_opt_t

    #: Credentials encoded or decoded at once by one process. munged serves a few threads and a short
    #: listen queue: a thousand callers at once (the controller under a burst of node requests) made
    #: libmunge give up with "cannot reach munged (socket)"; the commands were throttled by fork/exec.
    CONCURRENCY = 8

    def __init__(self, lib, libc):
        self.lib, self.libc = lib, libc
        self.gate = threading.BoundedSemaphore(self.CONCURRENCY)

    @classmethod
    def load(cls) -> "_LibMunge | None":
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("munge") or "libmunge.so.2")
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
        lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint32),
                                     ctypes.POINTER(ctypes.c_uint32)]
        lib.munge_ctx_strerror.restype = ctypes.c_char_p
        lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
        libc.free.argtypes = [ctypes.c_void_p]
        return cls(lib, libc)

    def _ctx(self, socket_path: str | None, ttl_s: int | None):
        ctx = self.lib.munge_ctx_create()
        if not ctx:
            raise AuthError("libmunge: cannot create a context (out of memory)")
        if socket_path:
            self.lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(self.OPT_SOCKET),
                                   ctypes.c_char_p(socket_path.encode()))
        if ttl_s is not None:
            self.lib.munge_ctx_set(ctypes.c_void_p(ctx), ctypes.c_int(self.OPT_TTL), ctypes.c_int(int(ttl_s)))
        return ctx

    def _why(self, ctx, err: int) -> str:
        text = self.lib.munge_ctx_strerror(ctx)
        return _MUNGE_STATUS.get(err) or (text.decode(errors="replace") if text else f"status {err}")

    def encode(self, payload: bytes, socket_path: str | None, ttl_s: int) -> str:
        ctx = self._ctx(socket_path, ttl_s)
        cred = ctypes.c_void_p()
        try:
            with self.gate:
                err = self.lib.munge_encode(ctypes.byref(cred), ctx, payload, len(payload))
            if err != 0:
                raise AuthError(f"munge failed: {self._why(ctx, err)}")
            return ctypes.string_at(cred.value).decode()
        finally:
            if cred.value:
                self.libc.free(cred)
            self.lib.munge_ctx_destroy(ctx)

    def decode(self, cred: str, socket_path: str | None) -> tuple[bytes, int, int, str]:
        ctx = self._ctx(socket_path, None)
        buf, length = ctypes.c_void_p(), ctypes.c_int(0)
        uid, gid = ctypes.c_uint32(0), ctypes.c_uint32(0)
        try:
            with self.gate:
                err = self.lib.munge_decode(cred.encode(), ctx, ctypes.byref(buf), ctypes.byref(length),
                                            ctypes.byref(uid), ctypes.byref(gid))
            if err != 0:
                raise AuthError(f"MUNGE credential rejected: {self._why(ctx, err)}")
            payload = ctypes.string_at(buf.value, length.value) if buf.value and length.value > 0 else b""
            addr = (ctypes.c_ubyte * 4)()
            host = ""
            if self.lib.munge_ctx_get(ctypes.c_void_p(ctx), ctypes.c_int(self.OPT_ADDR4), ctypes.byref(addr)) == 0:
                host = socket.inet_ntoa(bytes(addr))
            return payload, uid.value, gid.value, host
        finally:
            if buf.value:
                self.libc.free(buf)
            self.lib.munge_ctx_destroy(ctx)


class MungeAuth:
    """MUNGE credentials: libmunge in-process where it loads, else the munge/unmunge commands.

    Two sets of uids, kept apart: ``allowed_uids``, whose requests the controller serves (root: the hooks), and
    ``answer_uids``, whose answers a node accepts (the controller's user: root, or the SlurmUser that
    ``[auth].controller_user`` names; the same as ``allowed_uids`` when not given). Accepting the controller's
    user's answers must not make its requests accepted: a request from the SlurmUser is no hook's."""

    scheme = "munge"

    def __init__(self, socket: str | None = None, *, allowed_uids: tuple[int, ...] = (0,),
                 answer_uids: tuple[int, ...] | None = None,
                 ttl_s: int = 60, timeout_s: float = 5.0, munge_bin: str = "munge", unmunge_bin: str = "unmunge",
                 use_library: bool = True, replay_window_s: float = 0.0):
        self.socket = socket
        self.allowed_uids = tuple(allowed_uids)
        self.answer_uids = self.allowed_uids if answer_uids is None else tuple(answer_uids)
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.munge_bin = munge_bin
        self.unmunge_bin = unmunge_bin
        self.replay = ReplayCache(window_s=max(ttl_s * 2, 60, replay_window_s))
        self.lib = _LibMunge.load() if use_library else None

    def _argv(self, binary: str) -> list[str]:
        argv = [binary]
        if self.socket:
            argv += ["--socket", self.socket]
        return argv

    # The two primitives; everything else is built on them.
    def _encode(self, payload: bytes) -> str:
        if self.lib is not None:
            return self.lib.encode(payload, self.socket, self.ttl_s)
        argv = self._argv(self.munge_bin) + ["--ttl", str(self.ttl_s)]
        try:
            out = subprocess.run(argv, input=payload, capture_output=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AuthError(f"cannot create a MUNGE credential: {exc}") from exc
        if out.returncode != 0:
            raise AuthError(f"munge failed: {out.stderr.decode(errors='replace').strip()}")
        return out.stdout.decode().strip()

    def _decode(self, cred: str) -> tuple[bytes, int | None, int | None, str]:
        """(payload, uid, gid, encoding host) of a credential munged accepts; AuthError otherwise."""
        if self.lib is not None:
            return self.lib.decode(cred, self.socket)
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

        def _id(key: str) -> int | None:
            try:
                return int(meta[key].split()[0])
            except (KeyError, ValueError, IndexError):
                return None

        return payload, _id("UID"), _id("GID"), meta.get("ENCODE_HOST", "")

    def sign(self, body: bytes, node: str = "", *, path: str = "") -> str:
        """A header value carrying a fresh MUNGE credential bound to ``body`` and the route ``path``."""
        return "munge " + self._encode(f"{_REQUEST_TAG} {_digest(body)} {node} {_route(path)}".encode())

    def verify(self, header: str, body: bytes, now: float | None = None, *, path: str = "") -> Principal:
        """Decode the credential and check it covers ``body``, the route ``path`` and an allowed user."""
        scheme, _, cred = (header or "").partition(" ")
        if scheme != "munge" or not cred.startswith("MUNGE:"):
            raise AuthError("request has no MUNGE credential")
        payload, uid, gid, host = self._decode(cred)
        if uid is None or gid is None:
            raise AuthError("unmunge output lacks UID/GID")
        fields = payload.decode(errors="replace").rstrip("\n").split(" ")
        if len(fields) < 2 or fields[0] != _REQUEST_TAG or not _HEX64.fullmatch(fields[1]) \
                or not hmac.compare_digest(fields[1], _digest(body)):
            raise AuthError("MUNGE credential does not cover this request body")
        if " ".join(fields[3:]) != _route(path):
            raise AuthError("MUNGE credential was made for another route")
        if uid not in self.allowed_uids:
            raise AuthError(f"requests from uid {uid} are not allowed (allowed: {list(self.allowed_uids)})")
        self.replay.check_and_add(hashlib.sha256(cred.encode()).hexdigest(), time.time() if now is None else now)
        return Principal(uid, gid, host, "munge")

    def sign_response(self, request_header: str, status: int, body: bytes) -> str:
        """The controller's credential for its answer (a fresh MUNGE credential over the answer)."""
        return "munge " + self._encode(f"slurm-mig/1-response {_response_digest(request_header, status, body)}".encode())

    def verify_response(self, request_header: str, status: int, header: str | None, body: bytes) -> None:
        """Check the answer came from one of ``answer_uids`` (the controller's user: root, or
        ``[auth].controller_user``) and covers this request, status and body; munged refuses a replayed
        credential. Raises AuthError."""
        scheme, _, cred = (header or "").partition(" ")
        if scheme != "munge" or not cred.startswith("MUNGE:"):
            raise AuthError("answer has no MUNGE credential")
        try:
            payload, uid, _gid, _host = self._decode(cred)
        except AuthError as exc:
            raise AuthError(f"answer's {exc}") from None
        if uid not in self.answer_uids:
            raise AuthError(f"answer signed by uid {uid}, not by the controller (accepted: uid "
                            f"{', '.join(map(str, self.answer_uids))}; [auth].controller_user)")
        want = f"slurm-mig/1-response {_response_digest(request_header, status, body)}"
        if not hmac.compare_digest(payload.decode(errors="replace").rstrip("\n").encode(), want.encode()):
            raise AuthError("answer's MUNGE credential does not cover this answer")


# -- HMAC ------------------------------------------------------------------

def load_key(path: str) -> bytes:
    """Read a shared key file, refusing one that other users can read or write, or that another user owns
    (its owner could rewrite it, 0600 or not, with a key of their own), a symlink, or anything but a file.

    The checks are made on the file opened, not on the path before opening it: checked first and opened
    after, the path could be swapped for a symlink to another file in between, and that file was read."""
    try:
        # O_NONBLOCK: a FIFO put there must not hang the open (it is refused below, as not a file)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise AuthError(f"auth key file {path} is a symlink; refusing it") from None
        raise AuthError(f"cannot read auth key file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"auth key file {path} is not a regular file; refusing it")
        if st.st_mode & 0o077:
            raise AuthError(f"auth key file {path} has mode {oct(st.st_mode & 0o777)}; it must be 0600")
        if st.st_uid != os.geteuid():
            raise AuthError(f"auth key file {path} is owned by uid {st.st_uid}, not by uid {os.geteuid()} who "
                            f"reads it; refusing it (chown it)")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    key = b"".join(chunks).strip()
    if len(key) < 32:
        raise AuthError(f"auth key file {path} holds {len(key)} bytes; at least 32 are needed")
    return key


def create_key(path: str) -> None:
    """Write a new random key file with mode 0600 (never overwrites)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")


#: A node name on the channel (a request's ``node``; a key file's name): no "/", no leading ".", so never
#: a path outside a folder. Use with ``fullmatch``.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class NodeKeys:
    """The controller's folder of one HMAC key per node (``<node>.key``, 0600 like any key file).

    With it a node holds only its own key, so it cannot sign a request for another node: the shared
    key lets any node's root speak for every node (docs/security.md §7). A key file is re-read when it
    changes (a rotated key takes effect at once, without a restart).
    """

    def __init__(self, folder: str):
        self.folder = folder
        self._cache: dict[str, tuple[tuple, bytes]] = {}
        self._lock = threading.Lock()

    def path(self, node: str) -> str | None:
        """The key file of ``node``; None for a name that cannot name one."""
        if not NODE_NAME.fullmatch(node or "") or ".." in node:
            return None
        return os.path.join(self.folder, node + ".key")

    def _check_folder(self) -> None:
        """The folder must be ours and writable by nobody else: whoever can write it can plant (or, without
        the sticky bit, replace) ``<node>.key`` with a key they know, and sign as that node."""
        try:
            st = os.stat(self.folder)
        except OSError as exc:
            raise AuthError(f"cannot read node key folder {self.folder}: {exc.strerror}") from exc
        # root's folder is as safe as our own (a controller run as its own user, keys under /etc).
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o022:
            raise AuthError(f"node key folder {self.folder} has owner uid {st.st_uid} and mode "
                            f"{oct(stat.S_IMODE(st.st_mode))}; it must be uid {os.geteuid()}'s (or root's) and "
                            f"writable by its owner only (chown {os.geteuid()} {self.folder}; chmod 700 {self.folder})")

    def get(self, node: str) -> bytes | None:
        """``node``'s key; None when it has no key file. AuthError for a key file that is unsafe or short,
        or a folder others can write."""
        path = self.path(node)
        if path is None:
            return None
        self._check_folder()
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise AuthError(f"cannot read node key file {path}: {exc.strerror}") from exc
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
        with self._lock:
            hit = self._cache.get(node)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        key = load_key(path)
        with self._lock:
            self._cache[node] = (stamp, key)
        return key


class HmacAuth:
    """HMAC-SHA256 request signatures with a shared key, a clock-skew limit and a nonce cache."""

    scheme = "hmac"
    #: The reason a node's key file is refused is logged at most this often per node (and reason).
    UNSAFE_KEY_LOG_EVERY_S = 600.0

    def __init__(self, key: bytes | None, *, max_skew_s: float = 60.0, uid: int = 0,
                 node_keys: NodeKeys | None = None, replay_window_s: float = 0.0):
        """``key``: the shared key (a node: its own key). ``node_keys`` (the controller): verify each
        request with the key of the node it names, and fall back to ``key`` (if any) for a node that
        has no key file yet, so that keys can be rolled out node by node. ``replay_window_s``: how long
        a request's nonce is remembered, never less than the 2 x ``max_skew_s`` a timestamp is accepted."""
        if key is None and node_keys is None:
            raise AuthError("HMAC needs a key file, or a folder of node keys")
        self.key = key
        self.node_keys = node_keys
        self.max_skew_s = max_skew_s
        self.uid = uid
        self.replay = ReplayCache(window_s=max(2 * max_skew_s, replay_window_s))
        self.clock = time.monotonic  # for the log's rate limit only
        self._quiet = LogLimiter(self.UNSAFE_KEY_LOG_EVERY_S)

    def say_ended(self) -> None:
        """For each unsafe key file whose requests stopped (fixed, or the node gave up) with some refused
        since its last line: how many, which no next line will say (the API server calls this)."""
        for line, held in self._quiet.ended(self.clock()):
            log.error("%s: %d more requests refused for it since the last line about it, not logged, and none in "
                      "the last %.0f min", line, held, self.UNSAFE_KEY_LOG_EVERY_S / 60)

    def _key_for(self, node: str) -> bytes:
        try:
            key = self.node_keys.get(node) if self.node_keys is not None else None
        except AuthError as exc:
            # An unsafe or short key file: the admin reads why in the controller's log; the sender, who is
            # not authenticated yet, learns no path or file mode. Each request is refused (and counted by the
            # server), but anyone can send them: the reason is logged once per node per 10 minutes.
            held = self._quiet.say(str(exc), self.clock())
            if held is not None:
                log.error("%s (a request for node %s refused: so is each one until this is fixed; this line is logged "
                          "at most every %.0f min%s)", exc, node, self.UNSAFE_KEY_LOG_EVERY_S / 60,
                          f", {held} more requests refused for it since the last one" if held else "")
            raise AuthError(f"the controller cannot use node {node}'s key file (see its log)") from None
        if key is None:
            key = self.key
        if key is None:
            # Said to a sender not authenticated yet: the node, not where the controller keeps its keys.
            raise AuthError(f"no key for node {node!r} on the controller" if self.node_keys is not None
                            else "no HMAC key")
        return key

    def _response_mac(self, request_header: str, status: int, body: bytes) -> str:
        """The MAC of an answer: the request's credential, the status and the body, under the key the
        request was signed with (its node's own, with node keys; the node name is the header's 4th field)."""
        parts = (request_header or "").split(" ")
        key = self._key_for(parts[3] if len(parts) == 5 else "")
        return hmac.new(key, _response_digest(request_header, status, body).encode(), hashlib.sha256).hexdigest()

    @staticmethod
    def _mac(key: bytes, ts: str, nonce: str, node: str, path: str, body: bytes) -> str:
        msg = "\n".join([_REQUEST_TAG, ts, nonce, node, _route(path), _digest(body)]).encode()
        return hmac.new(key, msg, hashlib.sha256).hexdigest()

    def sign(self, body: bytes, node: str = "", now: float | None = None, *, path: str = "") -> str:
        """A header value with a MAC over the time, a fresh nonce, ``node``, the route ``path`` and ``body``."""
        ts = f"{time.time() if now is None else now:.3f}"
        nonce = secrets.token_hex(16)
        return f"hmac {ts} {nonce} {node} {self._mac(self._key_for(node), ts, nonce, node, path, body)}"

    def verify(self, header: str, body: bytes, now: float | None = None, *, path: str = "") -> Principal:
        parts = (header or "").split(" ")
        if len(parts) != 5 or parts[0] != "hmac":
            raise AuthError("request has no HMAC credential")
        _, ts, nonce, node, mac = parts
        # Every request comes from a node and names it: an empty or odd name would have no key file, fall
        # back to the shared key, and then name no node the controller could hold it to.
        if not NODE_NAME.fullmatch(node):
            raise AuthError("request's credential names no valid node")
        key = self._key_for(node)
        # compare_digest takes ASCII only (TypeError otherwise): a MAC is 64 hex digits, anything else is forged.
        if not _HEX64.fullmatch(mac) or not hmac.compare_digest(mac, self._mac(key, ts, nonce, node, path, body)):
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
        """The controller's MAC over its answer, bound to the request's credential, with the key the
        request was verified with (the node's own, with node keys)."""
        return "hmac " + self._response_mac(request_header, status, body)

    def verify_response(self, request_header: str, status: int, header: str | None, body: bytes) -> None:
        """Check the answer's MAC (the key, this request, this status and body). Raises AuthError."""
        scheme, _, mac = (header or "").partition(" ")
        if scheme != "hmac" or not _HEX64.fullmatch(mac):
            raise AuthError("answer has no HMAC signature")
        if not hmac.compare_digest(mac, self._response_mac(request_header, status, body)):
            raise AuthError("answer's signature does not match (wrong key, altered or replayed answer)")


def auth_from_settings(method: str, *, munge_socket: str | None = None, key_file: str | None = None,
                       max_skew_s: float = 60.0, allowed_uids: tuple[int, ...] = (0,),
                       node_keys_dir: str | None = None, replay_window_s: float = 0.0, controller_uid: int = 0):
    """Build the authenticator a config names ("munge" or "hmac"). ``node_keys_dir``: the controller's
    folder of per-node keys (then ``key_file``, the shared key, is optional: the fallback for nodes
    without a key file). ``controller_uid`` (munge; ``[auth].controller_user``): the uid whose answers a
    node accepts, besides root's; requests are still accepted from ``allowed_uids`` only."""
    if method == "munge":
        return MungeAuth(munge_socket, allowed_uids=allowed_uids, answer_uids=tuple(dict.fromkeys((0, controller_uid))),
                         ttl_s=int(max(max_skew_s, 10)), replay_window_s=replay_window_s)
    if method == "hmac":
        if node_keys_dir:
            if not os.path.isdir(node_keys_dir):
                raise AuthError(f"node key folder {node_keys_dir} does not exist (create it with `slurm-mig keys`)")
            shared = load_key(key_file) if key_file and os.path.exists(key_file) else None
            return HmacAuth(shared, max_skew_s=max_skew_s, node_keys=NodeKeys(node_keys_dir),
                            replay_window_s=replay_window_s)
        if not key_file:
            raise AuthError("auth method hmac needs a key_file")
        return HmacAuth(load_key(key_file), max_skew_s=max_skew_s, replay_window_s=replay_window_s)
    raise AuthError(f"unknown auth method {method!r} (expected 'munge' or 'hmac')")
