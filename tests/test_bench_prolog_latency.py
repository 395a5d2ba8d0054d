"""benchmarks/prolog_latency.py's own arithmetic, without a cluster."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "prolog_latency.py"
_spec = importlib.util.spec_from_file_location("prolog_latency_bench", _PATH)
prolog_latency = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = prolog_latency
_spec.loader.exec_module(prolog_latency)


def test_p90_interpolates_between_ranks():
    """p90 took the lower rank: of five values, the second largest (noticed in the benchmarks review)."""
    assert prolog_latency.p90([100, 200, 300, 400, 500]) == pytest.approx(460.0)
    assert prolog_latency.p90([7]) == 7
    assert "p90=460 ms" in prolog_latency._stats([500, 100, 400, 200, 300])
