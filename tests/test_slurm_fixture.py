"""The session fixture of tests/slurm, driven with a stand-in cluster (no Slurm is started here)."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_mig.errors import SlurmMigError


def _fixture_function():
    path = Path(__file__).resolve().parent / "slurm" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_slurm_conftest_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fixture = mod.slurm_cluster
    return mod, getattr(fixture, "_get_wrapped_function", lambda: fixture.__wrapped__)()


class _Cluster:
    fail_start = False
    stops: list

    def __init__(self, *a, **k):
        pass

    def start(self, **k):
        if self.fail_start:
            raise SlurmMigError("local cluster not ready after 60s; see logs in /x/log")

    def stop(self, **k):
        _Cluster.stops.append(k)


@pytest.mark.parametrize("fail_start, failed_tests, purged", [(True, 0, False), (False, 1, False), (False, 0, True)])
def test_the_cluster_logs_are_kept_when_something_failed(monkeypatch, tmp_path, fail_start, failed_tests, purged):
    mod, fn = _fixture_function()
    _Cluster.stops = []
    monkeypatch.setattr(_Cluster, "fail_start", fail_start)
    monkeypatch.setattr(mod, "LocalCluster", _Cluster)
    factory = SimpleNamespace(mktemp=lambda name: tmp_path / name)
    request = SimpleNamespace(session=SimpleNamespace(testsfailed=0))
    offered = {"tmp_path_factory": factory, "slurm_installed": None, "request": request}
    gen = fn(**{p: offered[p] for p in inspect.signature(fn).parameters})
    if fail_start:
        with pytest.raises(SlurmMigError):
            next(gen)
    else:
        next(gen)
        request.session.testsfailed = failed_tests
        with pytest.raises(StopIteration):
            next(gen)
    assert [bool(k.get("purge")) for k in _Cluster.stops] == [purged]
