"""apply_layout / assert_layout on the simulated GPU, and the `slurm-mig nvml` commands."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mig.cli import main
from slurm_mig.errors import InvalidLayout, TransitionBlocked
from slurm_mig.mig.layout import Layout, Slot, iter_valid_layouts, parse_layout
from slurm_mig.mig.profiles import get_model
from slurm_mig.mig.transitions import plan_transition
from slurm_mig.nvml import (
    InsufficientResources,
    MigModePending,
    NotSupported,
    ResetRequired,
    apply_layout,
    assert_layout,
    observed_layout,
)
from slurm_mig.nvml.simulated import SimulatedBackend, init_state

H100 = get_model("H100-80GB")
A30 = get_model("A30-24GB")


@pytest.fixture
def sim(tmp_path) -> SimulatedBackend:
    return init_state(tmp_path / "node.json", ["H100-80GB:2"], layouts={0: "3g@0,2g@4,1g@6"}, seed="apply")


def L(text: str, model=H100) -> Layout:
    return parse_layout(text, model)


# -- apply_layout --------------------------------------------------------------------
def test_apply_does_only_the_differing_steps_and_keeps_shared_instances(sim):
    kept = {m.slot: m.uuid for m in sim.instances(0)}
    result = apply_layout(sim, 0, L("3g@0,1g@4,1g@5,1g@6"))
    assert result.ok and result.reached
    assert [str(s) for s in result.done] == ["destroy 2g.20gb@4", "create 1g.10gb@4", "create 1g.10gb@5"]
    now = {m.slot: m.uuid for m in sim.instances(0)}
    assert now[Slot(0, "3g.40gb")] == kept[Slot(0, "3g.40gb")]
    assert now[Slot(6, "1g.10gb")] == kept[Slot(6, "1g.10gb")]
    assert result.after == L("3g@0,1g@4,1g@5,1g@6")
    again = apply_layout(sim, 0, L("3g@0,1g@4,1g@5,1g@6"))
    assert again.plan == [] and again.ok and again.reached


def test_an_idle_half_made_instance_is_made_whole_and_a_busy_neighbour_kept(sim):
    """A GPU instance without its compute instance counts as present in the layout, so a plan that keeps
    it did nothing and a job was bound to an instance with no UUID."""
    sim.destroy(0, Slot(4, "2g"))
    sim.half_make(0, Slot(4, "2g"))
    sim.set_in_use(0, "3g@0", "job 1")
    result = apply_layout(sim, 0, L("3g@0,2g@4,1g@6"))
    assert [str(s) for s in result.done] == ["destroy 2g.20gb@4", "create 2g.20gb@4"] and result.reached
    assert not any(i.half_made for i in sim.instances(0))
    # one the target drops is simply destroyed; one a job holds is left alone
    sim.half_make(1, Slot(0, "7g"))
    assert [str(s) for s in apply_layout(sim, 1, L("3g@0,3g@4")).done] == [
        "destroy 7g.80gb@0", "create 3g.40gb@0", "create 3g.40gb@4"]
    sim.destroy(0, Slot(6, "1g"))
    sim.half_make(0, Slot(6, "1g"))
    assert apply_layout(sim, 0, L("3g@0,2g@4,1g@6"), extra_busy=[Slot(6, "1g")]).plan == []


def test_dry_run_changes_nothing(sim):
    before = sim.instances(0)
    result = apply_layout(sim, 0, L("7g@0"), dry_run=True)
    assert result.dry_run and result.done == [] and result.after is None
    assert [s.action for s in result.plan] == ["destroy"] * 3 + ["create"]
    assert sim.instances(0) == before
    assert "would run 4 step(s)" in result.summary()


def test_a_busy_instance_blocks_and_nothing_changes(sim):
    sim.set_in_use(0, "2g@4", "job 5")
    before = sim.instances(0)
    with pytest.raises(TransitionBlocked) as info:
        apply_layout(sim, 0, L("3g@0,3g@4"))
    assert info.value.blocking == (Slot(4, "2g.20gb"),)
    assert sim.instances(0) == before
    # a target that keeps the busy instance is fine
    assert apply_layout(sim, 0, L("1g@0,1g@1,2g@2,2g@4,1g@6")).reached


def test_extra_busy_instances_bound_to_jobs_block_too(sim):
    with pytest.raises(TransitionBlocked):
        apply_layout(sim, 0, L("7g@0"), extra_busy=[Slot(6, "1g")])  # kinds are accepted
    with pytest.raises(InvalidLayout):
        apply_layout(sim, 0, L("7g@0"), extra_busy=[Slot(0, "7g")])  # not on the GPU


def test_hooks_run_around_every_step(sim):
    seen = []
    apply_layout(sim, 0, L("3g@0,3g@4"), before_step=lambda s: seen.append(("before", str(s))),
                 after_step=lambda s, e: seen.append(("after", str(s), e)))
    assert seen == [
        ("before", "destroy 2g.20gb@4"), ("after", "destroy 2g.20gb@4", None),
        ("before", "destroy 1g.10gb@6"), ("after", "destroy 1g.10gb@6", None),
        ("before", "create 3g.40gb@4"), ("after", "create 3g.40gb@4", None),
    ]


def test_a_failing_step_stops_the_run_and_is_reported(sim):
    sim.fail_next("create", InsufficientResources("injected: no room"))
    errors = []
    result = apply_layout(sim, 0, L("3g@0,1g@4,1g@5,1g@6"), after_step=lambda s, e: errors.append(e))
    assert not result.ok and not result.reached
    assert str(result.failed) == "create 1g.10gb@4"
    assert isinstance(result.error, InsufficientResources)
    assert [str(s) for s in result.done] == ["destroy 2g.20gb@4"]
    assert [str(s) for s in result.pending] == ["create 1g.10gb@4", "create 1g.10gb@5"]
    assert result.after == L("3g@0,1g@6")  # read again at the end
    assert errors[:1] == [None] and errors[1] is result.error and len(errors) == 2
    assert "stopped at step 2/3" in result.summary()
    with pytest.raises(InsufficientResources):
        result.raise_for_error()
    # the next apply picks up from where the GPU is
    assert apply_layout(sim, 0, L("3g@0,1g@4,1g@5,1g@6")).reached


def test_unexpected_exceptions_propagate_after_the_hook_saw_them(sim):
    class Broken:
        def __getattr__(self, name):
            return getattr(sim, name)

        def destroy(self, gpu, slot):
            raise RuntimeError("bug")

    seen = []
    with pytest.raises(RuntimeError):
        apply_layout(Broken(), 0, L("7g@0"), after_step=lambda s, e: seen.append(e))
    assert isinstance(seen[0], RuntimeError)


def test_model_mismatch_and_mig_off_are_refused(sim):
    with pytest.raises(InvalidLayout):
        apply_layout(sim, 0, L("4g@0", A30))
    sim.set_mig_mode(1, False)
    with pytest.raises(NotSupported):
        apply_layout(sim, 1, L("7g@0"))


def test_a_gpu_whose_mig_mode_changes_at_its_next_reset_is_left_as_it_is(sim):
    """`nvidia-smi -mig 0` waiting for a GPU reset read as plain "MIG on": apply_layout went on carving a GPU
    the admin was taking out of MIG mode. Now it refuses, dry runs included; reading it still works."""
    sim.set_in_use(0, "3g@0", "job 1")
    sim.set_mig_mode(0, False, pending=True)
    for dry_run in (True, False):
        with pytest.raises(MigModePending, match="creates and destroys nothing"):
            apply_layout(sim, 0, L("3g@0,3g@4"), dry_run=dry_run)
    assert str(observed_layout(sim, 0)) == "3g@0,2g@4,1g@6"
    assert not assert_layout(sim, 0, L("3g@0,2g@4,1g@6"))
    assert isinstance(MigModePending("x"), ResetRequired)  # handled as NVML's RESET_REQUIRED is


def test_assert_layout(sim):
    assert not assert_layout(sim, 0, L("3g@0,2g@4,1g@6"))
    diff = assert_layout(sim, 0, L("3g@0,3g@4"))
    assert diff and diff.missing == {Slot(4, "3g.40gb")} and diff.extra == {Slot(4, "2g.20gb"), Slot(6, "1g.10gb")}
    assert "missing 3g.40gb@4" in str(diff)


# -- property: the planner's steps always work on the simulated GPU ------------------------
VALID = {m.name: list(iter_valid_layouts(m)) for m in (H100, A30)}


@st.composite
def scenarios(draw):
    model = draw(st.sampled_from([H100, A30]))
    start = draw(st.sampled_from(VALID[model.name]))
    target = draw(st.sampled_from(VALID[model.name]))
    busy = draw(st.sets(st.sampled_from(sorted(start.slots)))) if start.slots else set()
    return model, start, target, frozenset(busy)


class Recording:
    """Wraps a backend, keeping the destroy calls."""

    def __init__(self, backend):
        self.backend = backend
        self.destroyed: list[Slot] = []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def destroy(self, gpu, slot):
        self.destroyed.append(slot)
        return self.backend.destroy(gpu, slot)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_applying_the_plan_reaches_the_target_and_spares_busy_instances(scenario):
    model, start, target, busy = scenario
    with tempfile.TemporaryDirectory() as folder:
        sim = init_state(Path(folder) / "s.json", [model.name], layouts={0: start})
        for slot in busy:
            sim.set_in_use(0, slot, "job")
        uuids = {m.slot: m.uuid for m in sim.instances(0)}
        backend = Recording(sim)
        try:
            plan = plan_transition(start, target, busy)
        except TransitionBlocked as exc:
            assert set(exc.blocking) <= busy
            with pytest.raises(TransitionBlocked):
                apply_layout(backend, 0, target)
            assert observed_layout(sim, 0) == start and backend.destroyed == []
            return
        result = apply_layout(backend, 0, target)
        assert result.ok and result.reached, result.summary()
        assert result.plan == plan
        assert not set(backend.destroyed) & busy
        after = {m.slot: m.uuid for m in sim.instances(0)}
        for slot in start.slots & target.slots:  # shared instances were kept, not re-made
            assert after[slot] == uuids[slot]
        assert {m.slot for m in sim.instances(0) if m.in_use} == busy


# -- the CLI ------------------------------------------------------------------------------
@pytest.fixture
def state(tmp_path, monkeypatch) -> str:
    monkeypatch.delenv("SLURM_MIG_NVML_BACKEND", raising=False)
    monkeypatch.delenv("SLURM_MIG_SIM_STATE", raising=False)
    # `nvml apply` reads the node's binding records under [node].cache_dir: this test's own, not the host's
    # (/var/lib/slurm-mig/node by default, where another node's records make it refuse).
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\ncache_dir = "{tmp_path}/node"\n')
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(cfg))
    path = str(tmp_path / "cli.json")
    assert main(["nvml", "sim-init", "--sim-state", path, "--gpus", "H100-80GB:2", "--layout", "0=3g@0,2g@4,1g@6",
                 "--seed", "cli"]) == 0
    return path


def _show(path, capsys) -> dict:
    capsys.readouterr()
    assert main(["nvml", "show", "--json", "--sim-state", path]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_show_json_and_table(state, capsys):
    data = _show(state, capsys)
    assert data["backend"] == "simulated"
    assert [g["layout"] for g in data["gpus"]] == ["3g@0,2g@4,1g@6", "empty"]
    first = data["gpus"][0]["instances"][0]
    assert (first["profile"], first["start"], first["size"], first["in_use"]) == ("3g.40gb", 0, 4, False)
    assert first["uuid"].startswith("MIG-")
    assert main(["nvml", "show", "--sim-state", state]) == 0
    out = capsys.readouterr().out
    assert "H100-80GB" in out and "3g.40gb" in out and first["uuid"][:12] in out


def test_cli_apply_dry_run_then_apply_then_assert(state, capsys):
    assert main(["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,3g@4", "--dry-run"]) == 0
    assert "would destroy 2g.20gb@4" in capsys.readouterr().out
    assert _show(state, capsys)["gpus"][0]["layout"] == "3g@0,2g@4,1g@6"
    assert main(["nvml", "assert", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,3g@4"]) == 1
    assert main(["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    assert "GPU 0 now: 3g@0,3g@4" in capsys.readouterr().out
    assert main(["nvml", "assert", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    assert "GPU 0 matches 3g@0,3g@4" in capsys.readouterr().out
    assert main(["nvml", "apply", "--sim-state", state, "--gpu", "1", "--layout", "7g@0", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] and result["reached"] and result["done"] == ["create 7g.80gb@0"]


def test_cli_apply_refuses_when_a_busy_instance_blocks(state, capsys):
    assert main(["nvml", "sim-busy", "--sim-state", state, "--gpu", "0", "2g@4", "--owner", "job42"]) == 0
    capsys.readouterr()
    rc = main(["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "7g@0"])
    err = capsys.readouterr().err
    assert rc == 3
    assert "refused" in err and "2g.20gb@4" in err and "Nothing was changed" in err
    assert _show(state, capsys)["gpus"][0]["layout"] == "3g@0,2g@4,1g@6"
    # --busy marks instances bound to a job that has no process yet
    rc = main(["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,2g@4", "--busy", "1g@6"])
    assert rc == 3
    assert main(["nvml", "sim-busy", "--sim-state", state, "--gpu", "0", "2g@4", "--clear"]) == 0
    assert main(["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "7g@0"]) == 0


def test_cli_reports_a_failed_step(state, capsys):
    SimulatedBackend(state).fail_next("create", "InsufficientResources")
    rc = main(["nvml", "apply", "--sim-state", state, "--gpu", "1", "--layout", "7g@0"])
    assert rc == 1
    assert "stopped at step 1/1" in capsys.readouterr().err


def test_cli_backend_from_environment(state, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_MIG_SIM_STATE", state)
    assert main(["nvml", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "simulated"
    monkeypatch.setenv("SLURM_MIG_NVML_BACKEND", "real")
    rc = main(["nvml", "show"])
    err = capsys.readouterr().err
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert rc == 1 and "NVML is unavailable" in err


def test_cli_backend_from_the_config_file(state, tmp_path, capsys, monkeypatch):
    """Without flags or environment, `nvml show` looks where this node's hooks look ([node] of the config
    file); it went to real NVML whatever the config said (found in review)."""
    monkeypatch.delenv("SLURM_MIG_SIM_STATE", raising=False)
    monkeypatch.delenv("SLURM_MIG_NVML_BACKEND", raising=False)
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{state}"\nsim_delay_scale = 0\n')
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(cfg))
    assert main(["nvml", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "simulated"
    cfg.write_text('[node]\nnvml_backend = "real"\n')
    assert main(["nvml", "show", "--json", "--sim-state", state]) == 0  # a flag still wins
    assert json.loads(capsys.readouterr().out)["backend"] == "simulated"


def test_cli_reads_this_nodes_gpus_from_a_per_node_config(tmp_path, capsys, monkeypatch):
    """A sim_state_path with {node} (one file per node, as the demo's) names the node's file for the hooks;
    `nvml` opened a file literally called "{node}.json", and ignored `slurm-mig --config`."""
    for var in ("SLURM_MIG_SIM_STATE", "SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    for name, layout in (("gpu01", "7g@0"), ("gpu02", "3g@0,3g@4")):
        init_state(tmp_path / f"{name}.json", ["H100-80GB"], layouts={0: layout}, seed=name)
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/{{node}}.json"\n')
    monkeypatch.setenv("SLURMD_NODENAME", "gpu01")
    assert main(["--config", str(cfg), "nvml", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"][0]["layout"] == "7g@0"
    assert main(["--config", str(cfg), "nvml", "show", "--json", "--node", "gpu02"]) == 0
    assert json.loads(capsys.readouterr().out)["gpus"][0]["layout"] == "3g@0,3g@4"


@pytest.mark.parametrize("argv", [["sim-init", "--force"], ["show", "--json"], ["check-tables", "--json"],
                                  ["apply", "--gpu", "0", "--layout", "3g@0,3g@4", "--json"],
                                  ["assert", "--gpu", "0", "--layout", "empty"],
                                  ["sim-busy", "--gpu", "0", "7g@0", "--owner", "j1"]])
def test_each_nvml_command_reads_its_config_once(tmp_path, capsys, monkeypatch, argv):
    """`nvml show`, `check-tables` and `apply` read (and checked) the config file four times, `sim-init` and
    `assert` twice: for the backend, the simulated state file, the binding records and the layout lock's wait,
    so a file changed meanwhile gave one command two configs. Each reads it once now (counted through the real
    load_config)."""
    import slurm_mig.config as C

    for var in ("SLURM_MIG_SIM_STATE", "SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG", "SLURM_MIG_SIM_DELAY_SCALE"):
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/{{node}}.json"\n'
                   f'cache_dir = "{tmp_path}/cache"\nsim_gpu_model = "H100-80GB"\nsim_gpu_count = 1\n')
    init_state(tmp_path / "n1.json", ["H100-80GB"], layouts={0: parse_layout("7g@0", H100)}, seed="n1")
    loads = []
    real = C.load_config
    monkeypatch.setattr(C, "load_config", lambda *a, **k: loads.append(a) or real(*a, **k))
    assert main(["--config", str(cfg), "nvml", *argv, "--node", "n1"]) in (0, 1)  # assert: 1, not that layout
    assert loads == [(str(cfg),)], loads
    capsys.readouterr()


@pytest.mark.parametrize("spec", ["", "  "])
def test_apply_with_a_blank_layout_is_refused_not_read_as_empty(tmp_path, capsys, spec):
    """`nvml apply --gpu 0 --layout "$LAYOUT"` with the variable unset read the blank spec as the empty layout and
    destroyed every idle instance on the GPU (exit 0); "empty" says that in words. Now exit 2, nothing changed.
    Found trying empty values for each nvml flag."""
    path = tmp_path / "s.json"
    init_state(path, ["H100-80GB"], layouts={0: parse_layout("3g@0,3g@4", H100)}, seed="b")
    for cmd in ("apply", "assert"):
        with pytest.raises(SystemExit) as exc:
            main(["nvml", cmd, "--sim-state", str(path), "--node", "n1", "--gpu", "0", "--layout", spec])
        assert exc.value.code == 2 and "no layout given" in capsys.readouterr().err
    assert main(["nvml", "assert", "--sim-state", str(path), "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    assert main(["nvml", "assert", "--sim-state", str(path), "--gpu", "0", "--layout", "empty"]) == 1


def test_cli_errors_are_clear(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_MIG_SIM_STATE", raising=False)
    monkeypatch.delenv("SLURM_MIG_NVML_BACKEND", raising=False)
    assert main(["nvml", "show", "--backend", "simulated"]) == 2
    assert "--sim-state" in capsys.readouterr().err
    missing = str(tmp_path / "none.json")
    assert main(["nvml", "show", "--sim-state", missing]) == 1
    assert "sim-init" in capsys.readouterr().err
    path = str(tmp_path / "x.json")
    assert main(["nvml", "sim-init", "--sim-state", path, "--gpus", "H100-80GB", "--layout", "3g@2"]) == 2
    assert main(["nvml", "sim-init", "--sim-state", path, "--gpus", "H100-80GB", "--force"]) == 0
    assert main(["nvml", "apply", "--sim-state", path, "--gpu", "0", "--layout", "4g@0,4g@4"]) == 2
    assert main(["nvml", "apply", "--sim-state", path, "--gpu", "3", "--layout", "7g@0"]) == 1
    assert "no GPU 3" in capsys.readouterr().err


@pytest.mark.parametrize("gpus, layout", [("H100-80GB:0", None), ("H100-80GB:65", None),
                                          ("H100-80GB:40,A30:40", None), ("H100-80GB:99999999999999999999", None),
                                          ("H100-80GB:\u00b2", None), ("H100-80GB:2", "\u00b2=3g@0")])
def test_sim_init_refuses_a_gpu_count_out_of_range(tmp_path, capsys, gpus, layout):
    """`nvml sim-init --gpus H100-80GB:0` wrote a node of no GPUs (exit 0), :100000 a 100,000-GPU node and a
    20-digit count ran out of memory; [node].sim_gpu_count allows 1-64. A superscript digit ("\u00b2", a digit
    to str.isdigit, not to int) in a count or a --layout GPU printed int()'s ValueError traceback."""
    path = tmp_path / "x.json"
    argv = ["nvml", "sim-init", "--sim-state", str(path), "--gpus", gpus] + (["--layout", layout] if layout else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("slurm-mig: error: bad ") and not path.exists()


def test_sim_init_takes_its_gpus_from_the_config_without_gpus(tmp_path, capsys, monkeypatch):
    """[node].sim_gpu_model and sim_gpu_count were checked but read by nothing: `nvml sim-init` demanded
    --gpus whatever the config said. Without --gpus it now makes MODEL x N from the config the other nvml
    commands read (--config, $SLURM_MIG_CONFIG, /etc/slurm-mig/slurm-mig.toml) and says so; --gpus still wins;
    with neither it refuses. The simulated backend still makes no GPUs by itself."""
    import slurm_mig.config as cfgmod

    for var in ("SLURM_MIG_SIM_STATE", "SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cfgmod, "SYSTEM_PATH", tmp_path / "no-such-dir" / "slurm-mig.toml")
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nsim_state_path = "{tmp_path}/node.json"\nsim_gpu_model = "A100-40GB"\nsim_gpu_count = 3\n'
                   f'cache_dir = "{tmp_path}/node"\n')

    def models(path):
        return [g.model.name for g in SimulatedBackend(path).gpus()]

    # the configured GPUs are not made behind an admin's back: no state file, no GPUs
    capsys.readouterr()
    assert main(["--config", str(cfg), "nvml", "show", "--json"]) == 1
    assert "no simulated GPUs" in capsys.readouterr().err and not (tmp_path / "node.json").exists()

    a = str(tmp_path / "a.json")
    assert main(["--config", str(cfg), "nvml", "sim-init", "--sim-state", a, "--layout", "1=7g@0"]) == 0
    out = capsys.readouterr().out
    assert models(a) == ["A100-40GB"] * 3
    assert f"(GPUs from [node].sim_gpu_model and sim_gpu_count in {cfg})" in out and "GPU 1 A100-40GB [7g@0]" in out

    monkeypatch.setenv("SLURM_MIG_CONFIG", str(cfg))  # the same file, found as the other commands find it
    b = str(tmp_path / "b.json")
    assert main(["nvml", "sim-init", "--sim-state", b]) == 0
    assert models(b) == ["A100-40GB"] * 3 and f"in {cfg})" in capsys.readouterr().out

    c = str(tmp_path / "c.json")  # --gpus overrides the config
    assert main(["nvml", "sim-init", "--sim-state", c, "--gpus", "H100-80GB:1"]) == 0
    assert models(c) == ["H100-80GB"] and "(GPUs from --gpus)" in capsys.readouterr().out

    monkeypatch.delenv("SLURM_MIG_CONFIG")  # no config file anywhere and no --gpus: refused, nothing made
    d = tmp_path / "d.json"
    assert main(["nvml", "sim-init", "--sim-state", str(d)]) == 2
    err = capsys.readouterr().err
    assert "--gpus" in err and "sim_gpu_model" in err and not d.exists()


def test_sim_init_and_sim_busy_find_the_state_file_where_show_and_apply_do(tmp_path, capsys, monkeypatch):
    """`nvml show`/`apply` fall back to [node].sim_state_path ({node}: the node's name, as the hooks read it), but
    `sim-init` and `sim-busy` demanded --sim-state or $SLURM_MIG_SIM_STATE, so sim-init made its GPUs (from the
    config's sim_gpu_model, da87f44) in a file the other commands and the hooks then did not read. Every nvml
    subcommand now resolves the path one way: --sim-state, $SLURM_MIG_SIM_STATE, then the config's path."""
    import slurm_mig.config as cfgmod

    for var in ("SLURM_MIG_SIM_STATE", "SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG", "SLURMD_NODENAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cfgmod, "SYSTEM_PATH", tmp_path / "no-such-dir" / "slurm-mig.toml")
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/gpus/{{node}}.json"\n'
                   f'sim_gpu_model = "A100-40GB"\nsim_gpu_count = 2\nsim_delay_scale = 0\n'
                   f'cache_dir = "{tmp_path}/node"\n')
    base = ["--config", str(cfg), "nvml"]

    # no state file: the simulated backend makes no GPUs by itself
    assert main([*base, "show", "--json", "--node", "gpu07"]) == 1
    assert "no simulated GPUs" in capsys.readouterr().err and not (tmp_path / "gpus").exists()

    assert main([*base, "sim-init", "--node", "gpu07", "--layout", "0=3g@0,3g@4"]) == 0
    out = capsys.readouterr().out
    made = tmp_path / "gpus" / "gpu07.json"
    assert made.exists() and not (tmp_path / "gpus" / "{node}.json").exists()
    assert f"simulated node at {made} (from [node].sim_state_path in {cfg})" in out
    assert [g.model.name for g in SimulatedBackend(made).gpus()] == ["A100-40GB"] * 2

    # show, apply and sim-busy read that same file
    assert main([*base, "sim-busy", "--node", "gpu07", "--gpu", "0", "3g@0", "--owner", "job9"]) == 0
    assert "in use by job9" in capsys.readouterr().out
    assert main([*base, "show", "--json", "--node", "gpu07"]) == 0
    shown = json.loads(capsys.readouterr().out)["gpus"][0]
    assert shown["layout"] == "3g@0,3g@4" and [i["in_use"] for i in shown["instances"]] == [True, False]
    assert main([*base, "apply", "--node", "gpu07", "--gpu", "1", "--layout", "7g@0"]) == 0
    assert [str(i.slot) for i in SimulatedBackend(made).instances(1)] == ["7g.40gb@0"]
    capsys.readouterr()

    # $SLURMD_NODENAME names the node as for the hooks; the flag and the environment still win
    monkeypatch.setenv("SLURMD_NODENAME", "gpu08")
    assert main([*base, "sim-init", "--gpus", "H100-80GB:1"]) == 0
    assert (tmp_path / "gpus" / "gpu08.json").exists()
    flag = tmp_path / "flag.json"
    assert main([*base, "sim-init", "--sim-state", str(flag)]) == 0
    assert f"simulated node at {flag} (from --sim-state)" in capsys.readouterr().out
    env = tmp_path / "env.json"
    monkeypatch.setenv("SLURM_MIG_SIM_STATE", str(env))
    assert main([*base, "sim-init"]) == 0 and env.exists()
    assert "(from $SLURM_MIG_SIM_STATE)" in capsys.readouterr().out

    # no flag, no environment, no config file: refused, naming all three; nothing made
    monkeypatch.delenv("SLURM_MIG_SIM_STATE")
    assert main(["nvml", "sim-init", "--gpus", "H100-80GB:1"]) == 2
    err = capsys.readouterr().err
    assert "--sim-state" in err and "SLURM_MIG_SIM_STATE" in err and "[node].sim_state_path" in err
    assert main(["nvml", "sim-busy", "--gpu", "0", "3g@0", "--clear"]) == 2
    assert "[node].sim_state_path" in capsys.readouterr().err


def test_nvml_as_root_refuses_a_config_others_may_change(state, tmp_path, capsys):
    """`slurm-mig nvml apply` (root, by hand) read [node].cache_dir (the binding records it trusts, the layout
    lock it takes) and the simulated GPUs' file from a config anyone could write, which the hooks on the same
    node refuse. Found with a 0666 $SLURM_MIG_CONFIG and `nvml apply --dry-run`: it ran. Refused now, by the
    hooks' rule, naming the file and the fix; a --sim-state apply runs again once fixed."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the node tools judge their config only as root")
    cfg = tmp_path / "slurm-mig.toml"
    cfg.chmod(0o666)
    capsys.readouterr()
    argv = ["nvml", "apply", "--sim-state", state, "--gpu", "0", "--layout", "3g@0,3g@4", "--dry-run"]
    assert main(argv) == 2
    assert f"config {cfg} is writable by anyone" in capsys.readouterr().err
    cfg.chmod(0o644)
    assert main(argv) == 0


def test_cli_as_root_refuses_a_node_folder_another_user_owns(tmp_path, capsys, monkeypatch):
    """`nvml` judged the folders the config names as the hooks do, but with "{node}" left as written: the node's
    own simulated-GPU folder ("{node}" made its name) owned by another user was never judged, and root read and
    wrote the GPUs' state in it. Judged now for the node acted for (--node, $SLURMD_NODENAME), as the hooks."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the check applies as root")
    for var in ("SLURM_MIG_SIM_STATE", "SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    for name in ("gpu01", "gpu02"):
        (tmp_path / name).mkdir(mode=0o755)
        init_state(tmp_path / name / "gpus.json", ["H100-80GB"], layouts={0: "7g@0"}, seed=name)
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/{{node}}/gpus.json"\n'
                   f'cache_dir = "{tmp_path}/cache"\n')
    cfg.chmod(0o644)
    os.chown(tmp_path / "gpu02", 65534, 65534)
    assert main(["--config", str(cfg), "nvml", "show", "--json", "--node", "gpu01"]) == 0
    capsys.readouterr()
    assert main(["--config", str(cfg), "nvml", "show", "--json", "--node", "gpu02"]) == 2
    err = capsys.readouterr().err
    assert "[node].sim_state_path" in err and f"chown root {tmp_path / 'gpu02'}" in err, err


@pytest.mark.parametrize("spec", ["", "  "])
def test_apply_with_a_blank_busy_spec_is_refused_not_read_as_nothing_busy(tmp_path, capsys, spec):
    """`nvml apply ... --busy "$KEEP"` with the variable unset read the blank spec as the empty layout: nothing kept
    busy, so the instances --busy was there to keep were destroyed (exit 0), as a blank --layout destroyed every
    idle one (99c6be6). Now exit 2, nothing changed; --busy empty (or leaving the flag out) says none."""
    path = tmp_path / "s.json"
    init_state(path, ["H100-80GB"], layouts={0: parse_layout("3g@0,3g@4", H100)}, seed="b")
    base = ["nvml", "apply", "--sim-state", str(path), "--node", "n1", "--gpu", "0", "--layout", "7g@0"]
    with pytest.raises(SystemExit) as exc:
        main([*base, "--busy", spec])
    assert exc.value.code == 2 and "--busy" in capsys.readouterr().err
    assert main(["nvml", "assert", "--sim-state", str(path), "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    assert main([*base, "--busy", "3g@0"]) != 0  # kept: the move is refused
    assert main(["nvml", "assert", "--sim-state", str(path), "--gpu", "0", "--layout", "3g@0,3g@4"]) == 0
    capsys.readouterr()
