"""training/evaluate.py's statistics: the intervals the held-out tables and `policy retrain` print."""

from __future__ import annotations

import math
import statistics

import pytest

from training.evaluate import ci, t95


@pytest.mark.parametrize("n, exact", [(2, 12.706), (5, 2.776), (11, 2.228), (12, 2.201), (21, 2.086),
                                      (31, 2.042), (61, 2.000), (121, 1.980), (1001, 1.962)])
def test_t_quantile_matches_the_tables_beyond_ten_degrees_of_freedom(n, exact):
    assert t95(n) == pytest.approx(exact, abs=0.003)


def test_interval_of_twenty_seeds_uses_the_t_quantile():
    values = [float(v) for v in range(20)]
    m, h = ci(values)
    assert m == 9.5
    assert h == pytest.approx(2.093 * statistics.stdev(values) / math.sqrt(20), rel=1e-3)
    assert math.isnan(ci([1.0])[1])
