"""benchmarks/prolog_latency.py's own arithmetic, without a cluster."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark

prolog_latency = load_benchmark("prolog_latency")


def test_p90_interpolates_between_ranks():
    """p90 took the lower rank: of five values, the second largest (noticed in the benchmarks review)."""
    assert prolog_latency.p90([100, 200, 300, 400, 500]) == pytest.approx(460.0)
    assert prolog_latency.p90([7]) == 7
    assert "p90=460 ms" in prolog_latency._stats([500, 100, 400, 200, 300])
