"""benchmarks/load_api.py's report, without starting a controller."""

from __future__ import annotations

from slurm_mig.config import NodeConfig
from tests.helpers import load_benchmark

load_api = load_benchmark("load_api")


def test_load_api_prints_its_figures_beside_the_bound():
    """The project's rule: every benchmark prints ours beside the bound. The bound of a hook's request is
    the timeout after which the hook gives up on it; it used to be printed nowhere."""
    assert load_api.REQUEST_TIMEOUT_S == NodeConfig().request_timeout_s
    result = {"nodes": 2, "auth": "hmac", "ok": 8, "errors": 0, "wall_s": 0.5, "throughput_rps": 16.0,
              "p50_ms": 10.0, "p99_ms": 20.0, "max_ms": 21.0, "sign_p50_ms": 0.1, "sign_p99_ms": 0.2,
              "request_timeout_s": 5.0, "over_timeout": 0,
              "per_route": {r: {"n": 2, "p50_ms": 10.0, "p99_ms": 20.0} for r in load_api.ROUTES},
              "outcomes_recorded": 2, "live_bindings_after": 0, "controller_errors": 0, "ticks_during_run": 1,
              "tick_max_s": 0.01, "origin_checks": None, "error_samples": [], "controller_error_samples": [],
              "passed": True}
    text = "\n".join(load_api.summary_lines(result))
    assert "p99 20.0 ms" in text and "bound: the hooks' request timeout, 5000 ms" in text
    assert text.splitlines()[-1] == "PASS"
