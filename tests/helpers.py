"""Small pieces several test files use."""

from __future__ import annotations

import importlib.util
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
