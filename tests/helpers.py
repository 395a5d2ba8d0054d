"""Small pieces several test files use."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is no package), registered so its dataclasses find it."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class MostAtOnce:
    """Wraps a function so that calls to it are counted while they run: ``most`` is how many ran at once.
    Each call holds its place for ``hold`` seconds, so that concurrent callers overlap."""

    def __init__(self, hold: float = 0.05) -> None:
        self.hold, self.most, self._running, self._lock = hold, 0, 0, threading.Lock()

    def wrap(self, fn):
        def counted(*args, **kwargs):
            with self._lock:
                self._running += 1
                self.most = max(self.most, self._running)
            time.sleep(self.hold)
            with self._lock:
                self._running -= 1
            return fn(*args, **kwargs)

        return counted


@contextlib.contextmanager
def raw_answer_server(answer: bytes, heard: list | None = None):
    """A TCP server on 127.0.0.1 that answers every connection with ``answer`` as it is (not HTTP, or HTTP cut
    short: what a controller killed mid-answer, or another service on its port, sends). Yields its port.
    What each connection sent first (up to 64 KiB) is appended to ``heard`` when given (a fake proxy)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:  # the answer, then EOF; the request read to its end, so no RST replaces what was sent
                conn.settimeout(5)
                first = conn.recv(65536)
                if heard is not None:
                    heard.append(first)
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield srv.getsockname()[1]
    finally:
        srv.close()
