"""`slurm-mig nvml apply` honours the node's binding records, as the hooks do.

A Prolog binds an instance before the job's CUDA processes start, so NVML does not report it in use
yet: an admin's apply read only NVML and could destroy it, and the job then started with a
CUDA_VISIBLE_DEVICES naming an instance that no longer existed. These run the real CLI on a simulated
node whose binding records are written by the hooks' own NodeState.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from slurm_mig.cli import main
from slurm_mig.mig.layout import Slot
from slurm_mig.node.localstate import BoundInstance, NodeState
from slurm_mig.nvml.simulated import SimulatedBackend, init_state

LAYOUT = "3g.40gb@0,2g.20gb@4,1g.10gb@6"


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Node gpu01 as its hooks see it: a config file naming its cache_dir and (per node) simulated GPUs."""
    for var in ("SLURM_MIG_NVML_BACKEND", "SLURM_MIG_SIM_STATE", "SLURM_MIG_SIM_DELAY_SCALE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "gpu01")
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\ncache_dir = "{tmp_path}/node"\nnvml_backend = "simulated"\n'
                   f'sim_state_path = "{tmp_path}/gpus/{{node}}.json"\nsim_delay_scale = 0\n')
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(cfg))
    (tmp_path / "gpus").mkdir()
    for name in ("gpu01", "gpu02"):
        init_state(tmp_path / "gpus" / f"{name}.json", ["H100-80GB:2"], layouts={0: LAYOUT}, seed=name)
    return tmp_path


def _gpu(node: Path, name: str = "gpu01") -> SimulatedBackend:
    return SimulatedBackend(node / "gpus" / f"{name}.json")


def _uuids(node: Path, name: str = "gpu01") -> dict[str, str]:
    return {str(i.slot): i.uuid for i in _gpu(node, name).instances(0)}


def _bind(node: Path, job: str, profile: str, start: int, name: str = "gpu01") -> NodeState:
    """What the Prolog writes: the instance is idle (its job's processes have not started)."""
    state = NodeState(node / "node" / name).ensure()
    uuid = _uuids(node, name)[f"{profile}@{start}"]
    state.write_binding(job, [BoundInstance(0, profile, start, uuid)], attempt=0)
    return state


def test_apply_refuses_to_recarve_an_idle_instance_bound_to_a_job(node, capsys):
    _bind(node, "42", "2g.20gb", 4)
    before = _uuids(node)
    for extra in ([], ["--dry-run"]):
        rc = main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,1g@4,1g@5,1g@6", *extra])
        err = capsys.readouterr().err
        assert rc == 3, err
        assert "refused" in err and "2g.20gb@4 (bound to job 42)" in err and "Nothing was changed" in err
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0", "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["refused"] and out["bound"] == {"2g.20gb@4": ["42"]}
    assert _uuids(node) == before  # nothing destroyed, nothing re-made


def test_a_layout_that_keeps_the_bound_instance_is_applied_and_the_dry_run_says_why(node, capsys):
    _bind(node, "42", "2g.20gb", 4)
    bound_uuid = _uuids(node)["2g.20gb@4"]
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,2g@4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would destroy 1g.10gb@6" in out and "kept: 2g.20gb@4, bound to job 42" in out
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,2g@4,1g@6", "--json", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["bound"] == {"2g.20gb@4": ["42"]}
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,2g@4"]) == 0
    assert _uuids(node) == {"3g.40gb@0": _uuids(node)["3g.40gb@0"], "2g.20gb@4": bound_uuid}


def test_only_this_nodes_bindings_and_gpus_count(node, capsys):
    """--node (else $SLURMD_NODENAME) picks both the binding records and the {node} GPU file."""
    _bind(node, "7", "2g.20gb", 4, name="gpu02")
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0"]) == 0  # gpu01: nothing bound
    assert list(_uuids(node)) == ["7g.80gb@0"]
    capsys.readouterr()
    assert main(["nvml", "apply", "--node", "gpu02", "--gpu", "0", "--layout", "7g@0"]) == 3
    assert "bound to job 7" in capsys.readouterr().err and "2g.20gb@4" in _uuids(node, "gpu02")


def test_a_host_name_that_is_not_the_nodes_slurm_name_does_not_read_as_no_bindings(node, capsys, monkeypatch):
    """In a root shell there is no $SLURMD_NODENAME, so the node name is the short host name, which need not
    be Slurm's NodeName (NodeName=gpu01 on host h17). Its state folder does not exist, and that read as "no
    bindings": the apply destroyed the instance a Prolog had bound to job 42 on gpu01. Refused now, naming
    the nodes whose records are there; --node says which one this is."""
    import socket

    _bind(node, "42", "2g.20gb", 4)
    monkeypatch.delenv("SLURMD_NODENAME")
    monkeypatch.setattr(socket, "gethostname", lambda: "h17.cluster.example")
    gpus = ["--sim-state", str(node / "gpus" / "gpu01.json")]
    before = _uuids(node)
    for extra in ([], ["--dry-run"]):
        rc = main(["nvml", "apply", *gpus, "--gpu", "0", "--layout", "7g@0", *extra])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert "h17" in err and "gpu01" in err and "--node" in err and "Nothing was changed" in err
    assert _uuids(node) == before
    assert main(["nvml", "apply", *gpus, "--node", "gpu01", "--gpu", "0", "--layout", "7g@0"]) == 3
    assert "bound to job 42" in capsys.readouterr().err and _uuids(node) == before


@pytest.mark.parametrize("damage", ["garbage", "folder"])
def test_an_unreadable_binding_record_fails_closed(node, capsys, damage):
    state = _bind(node, "42", "2g.20gb", 4)
    record = state.records_dir / "43.json"
    if damage == "garbage":
        record.write_text('{"job_id": "43", "instan')  # torn
    else:
        record.mkdir()
    before = _uuids(node)
    for extra in ([], ["--dry-run"]):
        # 7g@0 would pass 42's binding too: it is refused for the record it cannot read alone.
        rc = main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,2g@4", *extra])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert "job 43" in err and "Nothing was changed" in err and "--ignore-bindings" in err
    assert _uuids(node) == before
    # An admin who knows the node is empty may go past it, warned.
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0", "--ignore-bindings"]) == 0
    assert "WARNING: --ignore-bindings" in capsys.readouterr().err
    assert list(_uuids(node)) == ["7g.80gb@0"]


def test_a_node_without_state_has_no_bindings(node, capsys):
    assert not (node / "node").exists()
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,3g@4", "--dry-run"]) == 0
    assert not (node / "node").exists()  # a dry run takes no lock and creates nothing
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    assert list(_uuids(node)) == ["3g.40gb@0", "3g.40gb@4"]


def _a_prolog_starting_during_the_apply(node: Path, monkeypatch) -> list[str]:
    """While the apply changes the GPU, a Prolog starts on the node: it makes the node's folder (ensure) and
    tries to take the layout lock to carve and bind. What it found is returned."""
    import fcntl
    import os

    from slurm_mig.nvml import apply as apply_mod

    seen: list[str] = []
    real = apply_mod.apply_layout

    def during(*args, **kw):
        state = NodeState(node / "node" / "gpu01").ensure()
        fd = os.open(state.root / "apply.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("the Prolog took the lock")
        except BlockingIOError:
            seen.append("the Prolog waits")
        finally:
            os.close(fd)
        return real(*args, **kw)

    monkeypatch.setattr(apply_mod, "apply_layout", during)
    return seen


@pytest.mark.parametrize("missing", ["node folder", "cache_dir"])
def test_an_apply_on_a_node_without_its_folder_still_holds_the_hooks_lock(node, capsys, monkeypatch, missing):
    """Found in review. On a node whose state folder did not exist (no hook had run yet, or it had been
    removed) `nvml apply` took no lock: a Prolog starting meanwhile made the folder, carved and bound an
    instance, and the apply, which had read no binding, could destroy it. The apply now makes the folder as the
    hooks make it (0711 root; cache_dir and above 0755, whatever the umask: never writable by others) and
    holds the lock there."""
    import os
    import stat

    if missing == "node folder":
        (node / "node").mkdir(mode=0o755)
    seen = _a_prolog_starting_during_the_apply(node, monkeypatch)
    old_umask = os.umask(0)  # the folders' modes must not depend on it
    try:
        assert main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0"]) == 0, capsys.readouterr().err
    finally:
        os.umask(old_umask)
    assert seen == ["the Prolog waits"]
    assert list(_uuids(node)) == ["7g.80gb@0"]
    root = node / "node" / "gpu01"
    assert stat.S_IMODE(root.stat().st_mode) == 0o711
    assert not stat.S_IMODE((node / "node").stat().st_mode) & 0o022
    assert stat.S_IMODE((root / "apply.lock").stat().st_mode) == 0o600


def test_the_folder_an_apply_makes_for_a_host_name_keeps_that_name_guarded(node, capsys, monkeypatch):
    """The folder an apply makes for its lock has no records folder: a host name that is not the node's Slurm
    name is still refused once another name has records (the guard looks for records, which only hooks make)."""
    import socket

    monkeypatch.delenv("SLURMD_NODENAME")
    monkeypatch.setattr(socket, "gethostname", lambda: "h17")
    gpus = ["--sim-state", str(node / "gpus" / "gpu01.json")]
    assert main(["nvml", "apply", *gpus, "--gpu", "0", "--layout", LAYOUT]) == 0  # no records anywhere yet
    assert (node / "node" / "h17" / "apply.lock").exists() and not (node / "node" / "h17" / "records").exists()
    _bind(node, "42", "2g.20gb", 4)
    before = _uuids(node)
    capsys.readouterr()
    assert main(["nvml", "apply", *gpus, "--gpu", "0", "--layout", "7g@0"]) == 1
    assert "--node" in capsys.readouterr().err and _uuids(node) == before


def test_an_apply_that_cannot_make_the_nodes_folder_refuses(node, capsys, monkeypatch):
    """No folder and none can be made (not root, cache_dir not writable): refused, nothing changed, never
    applied without the lock."""
    import os

    real_mkdir = os.mkdir

    def mkdir(path, *args, **kw):
        if str(path).startswith(str(node / "node")):
            raise PermissionError(13, "Permission denied", str(path))
        return real_mkdir(path, *args, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    before = _uuids(node)
    rc = main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Nothing was changed" in err and str(node / "node" / "gpu01") in err
    assert _uuids(node) == before


def test_apply_waits_for_a_hook_holding_the_layout_lock(node, capsys):
    """A Prolog holds the lock from carving until its binding is written: an apply in between would read
    no binding and destroy the instance the Prolog is about to bind."""
    state = NodeState(node / "node" / "gpu01").ensure()
    codes = []
    with state.layout_lock():
        worker = threading.Thread(target=lambda: codes.append(
            main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0"])))
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and "2g.20gb@4" in _uuids(node)
        uuid = _uuids(node)["2g.20gb@4"]  # the "Prolog" binds it before letting go
        state.write_binding("42", [BoundInstance(0, "2g.20gb", 4, uuid)], attempt=0)
    worker.join(30)
    assert codes == [3] and _uuids(node)["2g.20gb@4"] == uuid


@pytest.mark.parametrize("how", ["flag", "config"])
def test_apply_waits_for_the_layout_lock_a_bounded_time_then_changes_nothing(node, capsys, how):
    """A holder hung inside NVML kept `nvml apply` waiting for the layout lock without end (the Prolog and the
    health check wait [node].layout_lock_wait_s). It now waits that long, or --lock-wait, then exits 75 (try
    again) saying why, having changed nothing."""
    if how == "config":
        cfg = node / "slurm-mig.toml"
        cfg.write_text(cfg.read_text() + "layout_lock_wait_s = 0.3\n")
    argv = ["nvml", "apply", "--gpu", "0", "--layout", "7g@0"] + (["--lock-wait", "0.3"] if how == "flag" else [])
    state = NodeState(node / "node" / "gpu01").ensure()
    before, codes = _uuids(node), []
    with state.layout_lock():
        worker = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
        worker.start()
        worker.join(10)
        alive = worker.is_alive()
    worker.join(30)
    assert not alive and codes == [75]
    err = capsys.readouterr().err
    assert f"the node's layout lock ({state.root / 'apply.lock'}) stayed held by another process for 0.3 s" in err
    assert "Nothing was changed" in err and "--lock-wait" in err
    assert _uuids(node) == before


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "1e9", "soon"])
def test_a_lock_wait_that_is_not_a_bounded_number_of_seconds_is_refused(node, capsys, bad):
    with pytest.raises(SystemExit) as exc:
        main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0", "--lock-wait", bad])
    assert exc.value.code == 2 and "--lock-wait" in capsys.readouterr().err


def test_a_bound_instance_missing_from_the_gpu_is_noted_not_kept(node, capsys):
    state = NodeState(node / "node" / "gpu01").ensure()
    state.write_binding("42", [BoundInstance(0, "1g.10gb", 5, "MIG-gone")], attempt=0)
    assert main(["nvml", "apply", "--gpu", "0", "--layout", "7g@0"]) == 0
    assert "job 42: bound to 1g.10gb@5 on GPU 0, which the GPU does not have" in capsys.readouterr().err
    assert _gpu(node).instances(0)[0].slot == Slot(0, "7g.80gb")
