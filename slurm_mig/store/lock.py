"""The Store's lock: reentrant, fair (granted in arrival order), with a timeout."""

from __future__ import annotations

import collections
import threading


class _FairRLock:
    """A reentrant lock granted in arrival order, with a timeout.

    threading.RLock is not fair: under many concurrent callers (every node's hooks at once, the tick
    among them) a few threads re-take it again and again while others wait past the busy timeout and
    fail. Here each waiter queues and is handed the lock by the releasing thread, so a caller waits
    for those ahead of it only.
    """

    def __init__(self):
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._count = 0
        self._waiters: collections.deque[tuple[int, threading.Lock]] = collections.deque()

    def acquire(self, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._count += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._count = me, 1
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        gate.acquire(timeout=timeout) if timeout is not None and timeout >= 0 else gate.acquire()
        with self._mutex:
            if self._owner == me:  # handed over (perhaps just as the wait timed out)
                return True
            self._waiters.remove((me, gate))
            return False

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a store lock this thread does not hold")
            self._count -= 1
            if self._count:
                return
            if self._waiters:
                self._owner, gate = self._waiters.popleft()
                self._count = 1
                gate.release()
            else:
                self._owner = None

    def __enter__(self) -> "_FairRLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
