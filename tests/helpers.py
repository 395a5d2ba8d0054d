"""Small pieces several test files use."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import socket
import stat
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

    def one(conn, _stop):
        with conn:  # the answer, then EOF; the request read to its end, so no RST replaces what was sent
            try:
                conn.settimeout(5)
                first = conn.recv(65536)
                if heard is not None:
                    heard.append(first)
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):
                    pass
            except OSError:
                return

    port, close = tcp_server_per_connection(one)
    try:
        yield port
    finally:
        close()


_MODE_EVENTS: list[list] = []  # the lists of the modes_given blocks now open


def _note_mode(event: str, args: tuple) -> None:
    if not _MODE_EVENTS or event not in ("os.mkdir", "os.chmod", "open"):
        return
    path = args[0]
    if not (isinstance(path, (str, bytes)) or hasattr(path, "__fspath__")):
        return  # os.fchmod (an fd), open() of an fd
    path = os.path.abspath(os.fsdecode(path))
    for seen in _MODE_EVENTS:
        if event == "open":
            if args[1] is None:  # os.open, with a mode of its own: an opener's (open()'s event came first)
                if seen and seen[-1][:2] == ("open()", path):
                    seen.pop()
            elif args[2] & os.O_CREAT:  # open(path, "w"/"a"/"x"...): a missing file is made 0666 less the umask
                seen.append(("open()", path, 0o666))
        else:
            seen.append((event, path, args[1]))


@contextlib.contextmanager
def modes_given():
    """Every mode a folder or file is made with or given while the block runs, as (event, absolute path, mode),
    from Python's audit events: os.mkdir (Path.mkdir, os.makedirs too), os.chmod, and open() to write without
    an opener ("open()": a missing file is made 0666, as Path.write_text and logging.FileHandler make it).
    What a file or folder was for a moment, which its mode at the end does not show (made 0777 under umask 0,
    chmod-ed 0700 after). os.open's own mode is not in its event (a file made so is not seen). The audit hook
    stays installed (it cannot be removed) and notes nothing outside a block."""
    if not getattr(modes_given, "_hooked", False):
        sys.addaudithook(_note_mode)
        modes_given._hooked = True
    seen: list = []
    _MODE_EVENTS.append(seen)
    try:
        yield seen
    finally:
        _MODE_EVENTS.remove(seen)


def wider_than_final(seen: list, umask: int) -> list[str]:
    """The moments ``seen`` (modes_given) gave a path more than it has at the end (made with ``mode`` less
    ``umask``; chmod-ed to ``mode``), as lines to show; [] when none was ever more open than its final mode.
    Only for paths that did not exist before the block (open() of a file that exists does not make it)."""
    out = []
    for event, path, mode in seen:
        had = mode if event == "os.chmod" else mode & ~umask
        try:
            final = stat.S_IMODE(os.stat(path).st_mode)
        except OSError:
            continue
        if had & ~final:
            out.append(f"{path}: {event} {had:o}, ends {final:o}")
    return out


def tcp_server_per_connection(one, backlog: int = 8):
    """A TCP server on 127.0.0.1 that runs ``one(conn, stop)`` in a thread of its own for each connection
    (``stop``: a threading.Event set by ``close``). Returns (port, close)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(backlog)
    stop = threading.Event()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn, stop), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()

    def close():
        stop.set()
        srv.close()

    return srv.getsockname()[1], close


@functools.lru_cache(maxsize=None)
def _nobody_import_problem() -> str | None:
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv to run as another user"
    nobody = pwd.getpwnam("nobody")
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                          sys.executable, "-I", "-c",
                          "import sys; sys.path.insert(0, sys.argv[1]); import slurm_mig.cli, sqlite_utils, rich", root],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return (f"nobody cannot run this checkout's Python ({sys.executable}) or import it from {root}: a folder "
                f"above it is closed to other users ({(out.stderr.strip().splitlines() or ['?'])[-1]})")
    return None


def skip_unless_nobody_can_run_the_project() -> None:
    """Skip a test that runs slurm-mig as nobody (setpriv) where nobody cannot: not root, no setpriv, or the
    checkout (or its venv) under a folder closed to other users, as a clone under mktemp -d or /root is."""
    import pytest

    problem = _nobody_import_problem()
    if problem:
        pytest.skip(problem)
