"""The controller's HTTP/JSON server for node hooks (stdlib only, threaded).

Routes are plain callables ``(payload: dict, principal: Principal) -> dict``.
POST routes need a valid credential (see auth.py); a few GET routes (health,
Prometheus metrics) are read-only and open, as scrapers expect.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from slurm_mig.api.auth import HEADER, RESPONSE_HEADER, AuthError, Principal
from slurm_mig.api.loglimit import LogLimiter
from slurm_mig.controlchars import visible
from slurm_mig.errors import SlurmMigError

log = logging.getLogger("slurm_mig.api")

MAX_BODY = 1 << 20  # a hook's request is a few hundred bytes; anything huge is hostile
IO_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 2048  # open connections served at once (one thread each); more get a 503
EX_TEMPFAIL = 75  # the exit_code of errors that mean "try again later" (StoreBusy, StoreUnavailable)  # per socket read/write; hooks send their whole request at once
# A refused request's WARNING line is written at most this often per kind and sender's address (the first
# in full, then one a window with the number held back since): anyone who can reach the port can send
# refused requests as fast as they like. Every refusal is still counted (on_error, the metric).
REFUSAL_LOG_EVERY_S = 60.0
REFUSAL_LOG_MAX_KEYS = 1024  # (kind, address) pairs remembered; past them the rest share one


def _shown(text) -> str:
    """What the server logs: the request path comes from anyone who can reach the port, before any
    authentication, and http.server keeps ESC in it."""
    return visible(str(text))


Route = Callable[[dict, Principal], dict]
GetRoute = Callable[[], tuple[str, bytes]]  # -> (content type, body)


class RequestRejected(SlurmMigError):
    """The request was understood and refused (bad field, impossible action); HTTP 422."""

    http_status = 422


class RequestForbidden(RequestRejected):
    """The sender may not make this request (a node speaking for another node); HTTP 403."""

    http_status = 403


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each given only what is left of one deadline (``restart``: now + ``limit_s``).

    A socket timeout bounds one read: a client that sends a byte a little more often than that holds its
    connection, and the server's thread, for as long as it likes (slowloris)."""

    def __init__(self, sock, limit_s: float):
        self._sock = sock
        self._limit_s = limit_s
        self._deadline = time.monotonic() + limit_s

    def restart(self) -> None:
        self._deadline = time.monotonic() + self._limit_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within the I/O timeout")
        self._sock.settimeout(left)
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._limit_s)  # the answer's writes get the whole timeout


class _Server(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: when many nodes connect at once (every health check
    # of a large cluster, a burst of job starts) the rest of their SYNs are dropped and each waits out
    # TCP's 1 s, 3 s, ... retransmits. The kernel caps this at net.core.somaxconn.
    request_queue_size = 1024

    def __init__(self, address, handler, max_connections: int = 2048, on_overload=None, on_idle=None):
        # One thread per connection: without a cap, a flood of connections (or of slow clients, each
        # held up to the I/O timeout) would start threads until memory runs out. Past the cap a
        # connection gets a 503 at once, which a node treats as "controller unavailable" (outbox,
        # fallback), and no thread.
        self._slots = threading.BoundedSemaphore(max_connections)
        self._on_overload = on_overload
        self._on_idle = on_idle
        super().__init__(address, handler)

    def service_actions(self):
        # serve_forever calls this between its polls (about every 0.5 s), requests or not.
        if self._on_idle:
            try:
                self._on_idle()
            except Exception:  # a log line must never stop the server
                log.exception("the API server's periodic work failed")

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            if self._on_overload:  # first: counted by the time the client reads its 503
                self._on_overload(client_address)
            body = b'{"error": "too many connections to the controller; try again"}'
            try:
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n"
                                + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ApiServer:
    """A threaded HTTP server dispatching authenticated JSON POSTs to routes."""

    def __init__(self, host: str, port: int, auth, routes: dict[str, Route],
                 get_routes: dict[str, GetRoute] | None = None, on_error: Callable[[str, str], None] | None = None,
                 *, io_timeout_s: float = IO_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS):
        self.auth = auth
        self.routes = routes
        self.get_routes = get_routes or {}
        self.on_error = on_error  # (kind, message) -> None, e.g. to count errors in metrics
        self.clock = time.monotonic  # for the refusal lines' rate limit only
        self._quiet = LogLimiter(REFUSAL_LOG_EVERY_S, REFUSAL_LOG_MAX_KEYS)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "slurm-mig"
            # A socket timeout: a client that connects and sends nothing (or half a body) is dropped after
            # this long instead of holding a server thread forever (slowloris).
            timeout = io_timeout_s

            def setup(self):
                super().setup()
                # The timeout bounds each socket read, not a request: a client that sent one byte a little
                # more often than that held its connection, and a thread, for ever (2,048 of them, and every
                # hook got a 503). Each request (from its first line, or the wait for it on a kept-alive
                # connection, to its last body byte) must arrive within the timeout.
                self.rfile.close()  # the socket's own file (closed, it leaves the socket open)
                self.rfile = io.BufferedReader(_DeadlineReader(self.connection, io_timeout_s),
                                               buffer_size=io.DEFAULT_BUFFER_SIZE)

            def handle_one_request(self):
                # HTTP/1.1 keeps one handler for the connection's requests: no credential of an earlier one may
                # sign the answer to this one, whatever its method (a GET's 404 signed for the POST before it
                # was a refusal a machine in the middle could hand the node).
                self.signed_request = None
                self.rfile.raw.restart()
                super().handle_one_request()

            def log_message(self, fmt, *args):  # route http.server's stderr chatter to logging
                log.debug("%s %s", self.address_string(), _shown(fmt % args))

            # The credential of the request being answered, once verified: every answer to it is signed,
            # bound to it, so a machine in the middle can neither forge nor replay the controller's answers.
            signed_request: str | None = None

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                response_auth = None
                if self.signed_request is not None and hasattr(server.auth, "sign_response"):
                    try:
                        response_auth = server.auth.sign_response(self.signed_request, status, body)
                    except AuthError as exc:  # e.g. munged down: the node will not trust an unsigned answer
                        server._error("auth", f"{self._peer()} {self.path}: cannot sign the answer: {exc}",
                                      peer=self._peer())
                self.send_response(status)
                if response_auth:
                    self.send_header(RESPONSE_HEADER, response_auth)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _peer(self) -> str:
                return str(self.client_address[0]) if self.client_address else ""

            def _json(self, status: int, obj: dict) -> None:
                self._send(status, json.dumps(obj).encode())

            def do_GET(self):
                route = server.get_routes.get(self.path.split("?", 1)[0])
                if route is None:
                    return self._json(404, {"error": f"no such path {self.path}"})
                try:
                    ctype, body = route()
                except Exception as exc:  # a broken metrics render must not kill the server
                    log.exception("GET %s failed", _shown(self.path))
                    return self._json(500, {"error": str(exc)})
                self._send(200, body, ctype)

            def do_POST(self):
                self.signed_request = None  # HTTP/1.1 keeps the handler for the connection's next request
                route = server.routes.get(self.path)
                try:
                    length = int(self.headers.get("Content-Length", "-1"))
                except ValueError:
                    length = -1
                if length < 0 or length > MAX_BODY:
                    server._error("bad_request", f"{self._peer()} {self.path}: body length {length} refused",
                                  peer=self._peer())
                    self.close_connection = True
                    return self._json(413 if length > MAX_BODY else 411, {"error": "missing or oversized body"})
                try:
                    body = self.rfile.read(length)
                except OSError as exc:  # the client stalled past the timeout, or went away
                    server._error("bad_request", f"{self._peer()} {self.path}: body not received: {exc}",
                                  peer=self._peer())
                    self.close_connection = True
                    return
                if len(body) != length:
                    server._error("bad_request", f"{self._peer()} {self.path}: body cut short", peer=self._peer())
                    self.close_connection = True
                    return
                try:
                    # The credential covers the route too: one signed for another path is refused here.
                    principal = server.auth.verify(self.headers.get(HEADER, ""), body, path=self.path)
                except AuthError as exc:
                    server._error("auth", f"{self._peer()} {self.path}: {exc}", peer=self._peer())
                    return self._json(401, {"error": str(exc)})
                self.signed_request = self.headers.get(HEADER, "")
                if route is None:
                    return self._json(404, {"error": f"no such path {self.path}"})
                try:
                    payload = json.loads(body or b"{}")
                    if not isinstance(payload, dict):
                        raise ValueError("the body must be a JSON object")
                except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
                    server._error("bad_request", f"{self._peer()} {self.path}: {type(exc).__name__}: {str(exc)[:200]}",
                                  peer=self._peer())
                    return self._json(400, {"error": f"malformed JSON: {str(exc)[:200]}"})
                try:
                    result = route(payload, principal)
                except SlurmMigError as exc:  # RequestRejected too
                    if getattr(exc, "exit_code", None) == EX_TEMPFAIL:
                        # The database is busy, full or broken (StoreBusy, StoreUnavailable): nothing is wrong with
                        # the request, so the node treats the controller as unavailable (keeps its message in the
                        # outbox, uses its fallback) rather than as a refusal (requeue, message set aside).
                        server._error("busy", f"{self._peer()} {self.path}: {exc}", peer=self._peer())
                        return self._json(503, {"error": str(exc), "kind": type(exc).__name__})
                    server._error("rejected", f"{self._peer()} {self.path}: {exc}", peer=self._peer())
                    return self._json(getattr(exc, "http_status", 422), {"error": str(exc), "kind": type(exc).__name__})
                except Exception as exc:
                    log.exception("POST %s failed", _shown(self.path))
                    server._error("internal", f"{self._peer()} {self.path}: {exc}", peer=self._peer())
                    return self._json(500, {"error": f"internal error: {exc}"})
                self._json(200, result)

        self.httpd = _Server((host, port), Handler, max_connections=max_connections,
                             on_overload=lambda addr: self._error("busy", f"{addr[0]}: over {max_connections} "
                                                                          f"open connections, answered 503",
                                                                  peer=str(addr[0])),
                             on_idle=self.say_ended)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    def _error(self, kind: str, message: str, *, peer: str | None = None) -> None:
        """A refused request: counted every time (``on_error``), logged at most once per ``REFUSAL_LOG_EVERY_S``
        per kind and sender's address (per kind and message when the address is not known), the number held
        back since said with the next line."""
        message = _shown(message)
        key = f"{kind} from {_shown(peer)}" if peer else f"{kind}: {message}"
        held = self._quiet.say(key, self.clock())
        if held == 0:
            log.warning("request refused (%s): %s", kind, message)
        elif held is not None:
            log.warning("request refused (%s): %s (and %d more %s refusals %s since the last line about them, not "
                        "logged: at most one line every %.0f s per kind and address; all are counted in "
                        "slurm_mig_api_errors_total)", kind, message, held, kind,
                        "from " + _shown(peer) if peer else "like it", REFUSAL_LOG_EVERY_S)
        if self.on_error:
            self.on_error(kind, message)

    def say_ended(self) -> None:
        """The closing line of each flood of refusals that stopped: the number held back since the last line
        about them, which no next line will say (and the same for the auth's own rate-limited lines)."""
        for key, held in self._quiet.ended(self.clock()):
            log.warning("request refused (%s): %d more since the last line about them, not logged, and none in the "
                        "last %.0f s; all are counted in slurm_mig_api_errors_total", key or "kinds and addresses "
                        f"past the {REFUSAL_LOG_MAX_KEYS} remembered", held, REFUSAL_LOG_EVERY_S)
        ended = getattr(self.auth, "say_ended", None)
        if ended is not None:
            ended()

    @property
    def address(self) -> tuple[str, int]:
        return self.httpd.server_address[:2]

    def start(self) -> "ApiServer":
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="slurm-mig-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
