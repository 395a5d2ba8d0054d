"""The controller's Prometheus counters, gauges and histograms (served at /metrics)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class Metrics:
    """Counters and gauges for /metrics (Prometheus text format); updated under a lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counters: dict = field(default_factory=dict)
    gauges: dict = field(default_factory=dict)
    histograms: dict = field(default_factory=dict)

    def inc(self, name: str, labels: tuple = (), by: float = 1.0) -> None:
        with self.lock:
            self.counters[(name, labels)] = self.counters.get((name, labels), 0.0) + by

    def set(self, name: str, labels: tuple, value: float) -> None:
        with self.lock:
            self.gauges[(name, labels)] = value

    def clear_gauge(self, name: str) -> None:
        with self.lock:
            for key in [k for k in self.gauges if k[0] == name]:
                del self.gauges[key]

    def observe(self, name: str, value: float, buckets: tuple[float, ...]) -> None:
        with self.lock:
            h = self.histograms.setdefault(name, {"buckets": buckets, "counts": [0] * len(buckets), "sum": 0.0, "n": 0})
            for i, b in enumerate(h["buckets"]):
                if value <= b:
                    h["counts"][i] += 1
            h["sum"] += value
            h["n"] += 1

    def render(self) -> bytes:
        def lab(labels: tuple) -> str:
            if not labels:
                return ""
            return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels) + "}"

        lines = []
        typed: set[str] = set()

        def declare(name: str, kind: str) -> None:
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} {kind}")

        with self.lock:
            for (name, labels), v in sorted(self.counters.items()):
                declare(name, "counter")
                lines.append(f"{name}{lab(labels)} {v:g}")
            for (name, labels), v in sorted(self.gauges.items()):
                declare(name, "gauge")
                lines.append(f"{name}{lab(labels)} {v:g}")
            for name, h in sorted(self.histograms.items()):
                declare(name, "histogram")
                for b, c in zip(h["buckets"], h["counts"]):
                    lines.append(f'{name}_bucket{{le="{b:g}"}} {c}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h["n"]}')
                lines.append(f"{name}_sum {h['sum']:g}")
                lines.append(f"{name}_count {h['n']}")
        return ("\n".join(lines) + "\n").encode()


def _esc(v) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


