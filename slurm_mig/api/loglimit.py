"""How often a log line may be said: for lines anyone who can reach the controller's port can make it say."""

from __future__ import annotations

import threading


class LogLimiter:
    """Which log lines to say: each distinct one at most once every ``every_s`` seconds, counting the
    times it was held back. For what anyone who can reach the port can make the controller say at will
    (a request naming a node whose key file is unsafe), which one line per request would flood the log with.
    At most ``max_keys`` lines are tracked: past them (paths of nodes that do not exist, say, where the
    folder cannot be searched) the rest share one slot.

    A flood that goes on is counted in its line's next saying; one that stops has no next saying, so
    :meth:`ended` gives the lines held back a whole window ago and not since, with their count, for a
    closing line."""

    def __init__(self, every_s: float, max_keys: int = 1024):
        self.every_s = every_s
        self.max_keys = max_keys
        # line -> [when last said, times held back since, when last held back]
        self._last: dict[str, list] = {}
        self._lock = threading.Lock()

    def say(self, line: str, now: float) -> int | None:
        """None: hold ``line`` back; otherwise say it now, with the number of times it was held back."""
        with self._lock:
            if line not in self._last and len(self._last) >= self.max_keys:
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_s}
                if len(self._last) >= self.max_keys:
                    line = ""  # the shared slot
            seen = self._last.get(line)
            if seen is not None and now - seen[0] < self.every_s:
                seen[1] += 1
                seen[2] = now
                return None
            self._last[line] = [now, 0, now]
            return 0 if seen is None else seen[1]

    def ended(self, now: float) -> list[tuple[str, int]]:
        """The floods that stopped: ``(line, times held back)`` for each line held back since it was last
        said and not once in the last ``every_s`` seconds (``""``: the shared slot). They are forgotten, as
        is every line said over a window ago, so the next of them is said as a first. Call it now and then
        (the API server does, about twice a second)."""
        out = []
        with self._lock:
            for line, (_said, held, last) in list(self._last.items()):
                if now - last >= self.every_s:
                    del self._last[line]
                    if held:
                        out.append((line, held))
        return out
