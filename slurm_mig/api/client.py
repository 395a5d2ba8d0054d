"""The node side of the channel: signed JSON POSTs to the controller (stdlib only, fast import)."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
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


#: The largest answer a node reads: the controller's are a few KiB at most (targets, a reason).
MAX_ANSWER = 1 << 20


class _Watchdog:
    """Shuts a call's socket down once its time is up. A socket timeout bounds each read, not an answer:
    whoever answers on the controller's address (another user who took its port while it was down, a machine
    in the middle) could send a byte a little more often than the timeout and hold a Prolog until Slurm
    killed it at PrologEpilogTimeout, which drains the node.

    ``ends_at`` (time.monotonic()): the attempt's own end, past which the socket is shut down however soon
    after its connection that comes (the hook's time limit, ControllerClient.time_left); None: ``after_s``
    from the connection only. Armed once the TCP connection is made (a TLS handshake after it is bounded by
    CPython's ssl module, one socket timeout in all: tried, a ClientHello answered a byte at a time)."""

    def __init__(self, after_s: float, ends_at: float | None = None):
        self.after_s = after_s
        self.ends_at = ends_at
        self.fired = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        # Our own descriptors of the call's connections (os.dup): the socket given to arm() stops being usable
        # once TLS wraps it (SSLContext.wrap_socket detaches it: its shutdown() then failed with EBADF, and an
        # https:// answer dripped a byte at a time was read for as long as it lasted), and once the call has
        # closed it its number may be another file's. Ours stay this connection's until disarm() closes them.
        self._socks: list[socket.socket] | None = []

    def arm(self, sock) -> None:
        """Watch ``sock`` (each connection of the call: a redirect's too); the time counts from the first."""
        with self._lock:
            if self._socks is None:  # disarmed: the call is over
                return
            try:
                own = socket.socket(fileno=os.dup(sock.fileno()))
            except OSError:
                return
            self._socks.append(own)
            if self.fired:  # its time was up already
                self._shutdown(own)
                return
            if self._timer is not None:
                return
            after = self.after_s
            if self.ends_at is not None:
                after = max(0.0, min(after, self.ends_at - time.monotonic()))
            self._timer = threading.Timer(after, self._expire)
            self._timer.daemon = True
            self._timer.start()

    @staticmethod
    def _shutdown(sock) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)  # a read blocked on the connection returns at once
        except OSError:
            pass

    def _expire(self) -> None:
        with self._lock:
            if self._socks is None:
                return
            self.fired = True
            for sock in self._socks:
                self._shutdown(sock)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            socks, self._socks = self._socks or [], None
        for sock in socks:
            sock.close()


def _bounded_connect(watchdog: _Watchdog):
    """socket.create_connection, but the addresses a name resolves to (::1 and 127.0.0.1 for "localhost", a
    dual-stack head node) are tried within one bound, the attempt's end (``watchdog.ends_at``), not a full
    timeout each: with the controller's packets dropped, each took request_timeout_s before the next was
    tried. The watchdog is armed as soon as the TCP connection is made."""

    def connect(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None, **kw):
        host, port = address
        last: OSError | None = None
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
            step = timeout if isinstance(timeout, (int, float)) else None
            if watchdog.ends_at is not None:
                left = watchdog.ends_at - time.monotonic()
                if left <= 0:
                    break
                step = left if step is None else min(step, left)
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(step)
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
                sock.settimeout(timeout if isinstance(timeout, (int, float)) else None)
            except OSError as exc:
                last = exc
                sock.close()
                continue
            watchdog.arm(sock)
            return sock
        raise last if last is not None else socket.timeout(f"no time left to connect to {host}:{port}")

    return connect


class _Watched:
    """An HTTP(S) handler whose connections arm ``watchdog`` once connected."""

    def __init__(self, watchdog: _Watchdog, **kw):
        super().__init__(**kw)
        self.watchdog = watchdog

    def do_open(self, http_class, req, **kw):
        watchdog = self.watchdog

        class Connection(http_class):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self._create_connection = _bounded_connect(watchdog)

        return super().do_open(Connection, req, **kw)


class _WatchedHTTP(_Watched, urllib.request.HTTPHandler):
    pass


def _watched_opener(watchdog: _Watchdog) -> urllib.request.OpenerDirector:
    """direct_opener's (no proxy), with each connection's time bounded by ``watchdog``."""
    handlers = [urllib.request.ProxyHandler({}), _WatchedHTTP(watchdog)]
    if hasattr(urllib.request, "HTTPSHandler"):
        handlers.append(type("_WatchedHTTPS", (_Watched, urllib.request.HTTPSHandler), {})(watchdog))
    return urllib.request.build_opener(*handlers)


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

    #: The least time an attempt is started with (a signed request and its answer on a healthy channel take
    #: milliseconds; under a second left, the hook's fallback is what it needs the time for).
    MIN_ATTEMPT_S = 0.5

    def __init__(self, url: str, auth, node: str, timeout_s: float = 5.0, retries: int = 1,
                 verify_responses: bool = True, time_left=None):
        self.url = url.rstrip("/")
        self.auth = auth
        self.node = node
        self.timeout_s = timeout_s
        self.retries = retries
        #: None, or a function giving the seconds this process may still spend on calls (a Prolog's or an
        #: Epilog's time limit, less what it keeps for its fallback: Node.time_left). A call starts no attempt
        #: (nor the retry) without at least MIN_ATTEMPT_S of it, and each attempt ends with it, whatever the
        #: other end does; without it a call could take (3 x timeout_s) x (retries + 1) + the pauses between.
        self.time_left = time_left
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
            left = self.time_left() if self.time_left is not None else None
            if left is not None and left < self.MIN_ATTEMPT_S:
                why = f"no time left for {path} within this hook's time limit ([node].hook_time_limit_s)"
                raise ControllerUnavailable(f"{last}; {why}" if last is not None else why)
            req = urllib.request.Request(self.url + path, data=body, method="POST")
            req.add_header("Content-Type", "application/json")
            try:
                signed = self.auth.sign(body, self.node, path=path)
            except SlurmMigError as exc:
                # No credential (munged down): as good as no controller, so callers take their fallback.
                raise ControllerUnavailable(f"cannot sign the request: {exc}") from exc
            req.add_header(HEADER, signed)
            try:
                status, headers, answer = self._post(req, left)
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
                pause = 0.2 * (attempt + 1)
                left = self.time_left() if self.time_left is not None else None
                if left is not None and left < pause + self.MIN_ATTEMPT_S:
                    break  # no time for the retry: said as the last failure
                time.sleep(pause)
        assert last is not None
        raise last

    def _post(self, req, left: float | None = None) -> tuple[int, object, bytes]:
        """(status, headers, body) of one request; ControllerUnavailable when there is no answer.

        ``timeout_s`` bounds each step (connecting, over every address the name resolves to, sending, each
        read), and the whole answer must be in within two more once connected (_Watchdog): at most three in
        all, whatever the other end sends; and at most ``left`` seconds (the hook's time limit) in all."""
        bound = 3 * self.timeout_s if left is None else min(3 * self.timeout_s, left)
        watchdog = _Watchdog(2 * self.timeout_s, time.monotonic() + bound)
        timeout = self.timeout_s if left is None else max(0.001, min(self.timeout_s, left))
        try:
            return self._exchange(req, watchdog, timeout)
        except ControllerUnavailable as exc:
            if watchdog.fired:
                raise ControllerUnavailable(f"controller at {self.url}: no whole answer within "
                                            f"{bound:g} s ({exc})") from None
            raise
        finally:
            watchdog.disarm()

    def _read(self, resp) -> bytes:
        """An answer's body, refused past MAX_ANSWER bytes (never read whole into memory)."""
        length = getattr(resp, "length", None)  # http.client's Content-Length, None without one
        if length is not None:
            if length > MAX_ANSWER:
                raise ControllerUnavailable(f"controller at {self.url}: answer of {length} bytes is larger than "
                                            f"{MAX_ANSWER}; not read")
            return resp.read()  # whole (IncompleteRead when cut short)
        body = resp.read(MAX_ANSWER + 1)
        if len(body) > MAX_ANSWER:
            raise ControllerUnavailable(f"controller at {self.url}: answer larger than {MAX_ANSWER} bytes; not read")
        return body

    def _exchange(self, req, watchdog: _Watchdog, timeout: float | None = None) -> tuple[int, object, bytes]:
        try:
            with _watched_opener(watchdog).open(req, timeout=self.timeout_s if timeout is None else timeout) as resp:
                return resp.status, resp.headers, self._read(resp)
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, exc.headers, self._read(exc)
            except (OSError, http.client.HTTPException) as err:
                raise ControllerUnavailable(f"controller at {self.url}: answer {exc.code} cut short: {err}") from None
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            raise ControllerUnavailable(f"controller at {self.url} unreachable: {getattr(exc, 'reason', exc)}") from None
        except http.client.HTTPException as exc:
            # Cut short (IncompleteRead: a controller killed mid-answer) or not HTTP at all (BadStatusLine,
            # LineTooLong: another service on the port); the bytes it sent are shown escaped and cut.
            raise ControllerUnavailable(f"controller at {self.url} unreachable: no HTTP answer "
                                        f"({type(exc).__name__}: {ascii(str(exc))[:200]})") from None
