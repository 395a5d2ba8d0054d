"""Command-line numbers are checked where they are given: a float flag took nan, inf and negatives, which
failed far from the flag (``time.sleep(-1)`` after a first round of ``node sync --loop``, a demo that never
gives up) or spun (``top --interval 0``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from slurm_mig.argtypes import number, seconds
from slurm_mig.cli import build_parser

FLAGS = [
    (["node", "sync", "--loop"], "--loop"),
    (["top", "--interval"], "--interval"),
    (["cluster", "up", "--timeout"], "--timeout"),
    (["demo", "--timeout"], "--timeout"),
    (["nvml", "apply", "--gpu", "0", "--layout", "7g@0", "--lock-wait"], "--lock-wait"),
]


@pytest.mark.parametrize("argv, flag", FLAGS)
@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "1e99", "soon"])
def test_a_seconds_flag_refuses_what_is_no_bounded_number_of_seconds(argv, flag, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, bad])
    assert exc.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [f for f in FLAGS if f[1] != "--lock-wait"])
def test_an_interval_or_timeout_of_zero_is_refused_but_a_lock_wait_of_zero_tries_once(argv, flag, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "0"])
    assert "give more than 0 to 86400 seconds" in capsys.readouterr().err
    ok = build_parser().parse_args([*FLAGS[-1][0], "0"])
    assert ok.lock_wait == 0.0


@pytest.mark.parametrize("argv, flag", FLAGS)
def test_a_good_number_of_seconds_is_taken_as_a_float(argv, flag):
    args = build_parser().parse_args([*argv, "2.5"])
    assert 2.5 in vars(args).values()


@pytest.mark.parametrize("flag", ["--nodes", "--gpus", "--jobs"])
def test_demo_counts_are_whole_numbers_of_at_least_one(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", flag, "0"])
    assert exc.value.code == 2 and "0 is too small (at least 1)" in capsys.readouterr().err


def test_number_bounds_and_messages():
    parse = number(0.0, 10.0, more_than=True, unit="seconds")
    assert parse("10") == 10.0 and parse("1e-3") == 0.001
    for bad, said in [("0", "give more than 0 to 10 seconds"), ("10.5", "give more than 0 to 10 seconds"),
                      ("x", "not a number of seconds: 'x'")]:
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse(bad)
    assert seconds()("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match="give 0 to 86400 seconds"):
        seconds()("86401")


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "1e300", "1000.5", "slow"])
def test_the_simulated_delay_factor_is_one_bounded_number_from_flag_environment_and_config(bad, tmp_path, capsys,
                                                                                          monkeypatch):
    """[node].sim_delay_scale took any finite number (1e300: a simulated create then raised OverflowError in
    time.sleep, in the Prolog), and --sim-delay-scale and $SLURM_MIG_SIM_DELAY_SCALE any float (inf: the same;
    nan: ValueError; 1e9: a create that sleeps for years). All three now take 0 to MAX_SIM_DELAY_SCALE (1000)."""
    from slurm_mig.cli import main
    from slurm_mig.config import parse_config_text
    from slurm_mig.errors import ConfigError
    from slurm_mig.nvml.cli import backend_settings

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["nvml", "show", "--sim-delay-scale", bad])
    assert exc.value.code == 2 and "argument --sim-delay-scale:" in capsys.readouterr().err

    for var in ("SLURM_MIG_NVML_BACKEND", "SLURM_MIG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    state = tmp_path / "s.json"
    monkeypatch.setenv("SLURM_MIG_SIM_STATE", str(state))
    monkeypatch.setenv("SLURM_MIG_SIM_DELAY_SCALE", bad)
    with pytest.raises(ConfigError, match="SLURM_MIG_SIM_DELAY_SCALE"):
        backend_settings(build_parser().parse_args(["nvml", "show"]))
    assert main(["nvml", "show"]) == 2 and not state.exists()

    toml = '"slow"' if bad == "slow" else bad  # TOML reads nan, inf, -1, 1e300 and 1000.5 as floats
    with pytest.raises(ConfigError, match=r"sim_delay_scale: expected a number >= 0 and <= 1000"):
        parse_config_text(f"[node]\nsim_delay_scale = {toml}\n", "t.toml")


def test_a_delay_factor_within_the_bound_is_taken_everywhere(tmp_path, monkeypatch):
    from slurm_mig.config import parse_config_text
    from slurm_mig.nvml.cli import backend_settings

    assert build_parser().parse_args(["nvml", "show", "--sim-delay-scale", "1000"]).sim_delay_scale == 1000.0
    assert parse_config_text("[node]\nsim_delay_scale = 0\n", "t.toml").node.sim_delay_scale == 0.0
    monkeypatch.delenv("SLURM_MIG_NVML_BACKEND", raising=False)
    monkeypatch.setenv("SLURM_MIG_SIM_STATE", str(tmp_path / "s.json"))
    monkeypatch.setenv("SLURM_MIG_SIM_DELAY_SCALE", "2.5")
    assert backend_settings(build_parser().parse_args(["nvml", "show"]))["delay_scale"] == 2.5



def test_the_simulated_delay_factor_comes_from_flag_then_environment_then_the_configs_state_file_else_0(
        tmp_path, monkeypatch, capsys):
    """The order --sim-delay-scale's help states (backend_settings): the flag, else $SLURM_MIG_SIM_DELAY_SCALE, else
    the config's [node].sim_delay_scale when the config's state file is the one used (a --sim-state or
    $SLURM_MIG_SIM_STATE file is instant: the config's delay goes with the config's file), else 0. Nothing pinned
    it: each level is tested here against the one below it."""
    from slurm_mig.config import NodeConfig
    from slurm_mig.nvml.cli import backend_settings

    for var in ("SLURM_MIG_NVML_BACKEND", "SLURM_MIG_SIM_STATE", "SLURM_MIG_SIM_DELAY_SCALE", "SLURM_MIG_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["nvml", "show", "--help"])
    assert ("(default: $SLURM_MIG_SIM_DELAY_SCALE, else the config's [node].sim_delay_scale with its state file, "
            "else 0)") in " ".join(capsys.readouterr().out.split())
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/{{node}}.json"\n'
                   'sim_delay_scale = 5\n')
    bare = tmp_path / "bare.toml"
    bare.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/{{node}}.json"\n')

    def delay(conf: Path, *argv: str, env: str | None = None, state: str | None = None) -> float:
        for var, val in (("SLURM_MIG_SIM_DELAY_SCALE", env), ("SLURM_MIG_SIM_STATE", state)):
            if val is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, val)
        got = backend_settings(build_parser().parse_args(["--config", str(conf), "nvml", "show", "--node", "n1",
                                                          *argv]))
        assert got["kind"] == "simulated", got
        return got["delay_scale"]

    own = str(tmp_path / "own.json")
    # the config's state file: flag > environment > config
    assert delay(cfg) == 5.0
    assert delay(cfg, env="7") == 7.0
    assert delay(cfg, "--sim-delay-scale", "9", env="7") == 9.0
    assert delay(cfg, "--sim-delay-scale", "0", env="7") == 0.0  # 0 is a value, not "none given"
    assert delay(cfg, env="0") == 0.0
    # a config without the key: its default, with its state file
    assert delay(bare) == NodeConfig().sim_delay_scale
    # another state file (--sim-state or $SLURM_MIG_SIM_STATE): not the config's delay, so 0 unless told
    assert delay(cfg, "--sim-state", own) == 0.0
    assert delay(cfg, state=own) == 0.0
    assert delay(cfg, "--backend", "simulated", "--sim-state", own) == 0.0
    assert delay(cfg, "--sim-state", own, env="7") == 7.0
    assert delay(cfg, "--sim-state", own, "--sim-delay-scale", "9", env="7") == 9.0
    # no config file at all
    assert delay(tmp_path / "none.toml", "--sim-state", own) == 0.0

@pytest.mark.parametrize("argv", [["jobs", "--limit"], ["decisions", "--limit"], ["top", "--page"]])
@pytest.mark.parametrize("bad", ["-1", "0"])
def test_a_limit_or_page_is_a_whole_number_of_at_least_one(argv, bad, capsys):
    """`jobs --limit -1` and `decisions --all --limit -1` listed every row (SQLite reads LIMIT -1 as none),
    though the help says "at most this many"; `--limit 0` listed nothing, `top --page -3` the first page."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, bad])
    assert exc.value.code == 2 and f"{bad} is too small (at least 1)" in capsys.readouterr().err
    assert build_parser().parse_args([*argv, "3"]).__dict__[argv[1].lstrip("-")] == 3


@pytest.mark.parametrize("where", ["sim-busy instance", "simulate --milli-map", "db_group", "sim-init --gpus",
                                   "sim-init --layout"])
def test_a_number_with_a_digit_int_refuses_is_an_error_not_a_traceback(where, tmp_path, capsys):
    """"²" is a digit to str.isdigit() and not to int(): `nvml sim-busy --gpu 0 3g@²`, `simulate --milli-map
    7g:²000` and a [controller].db_group of "²" ended in int()'s ValueError traceback. Each now refuses it as
    any other bad value (argtypes.ascii_digits, the one test, which nvml sim-init and parse_gpu_spec already made
    with a regex each)."""
    from slurm_mig.argtypes import ascii_digits
    from slurm_mig.cli import main
    from slurm_mig.errors import StoreError
    from slurm_mig.nvml.simulated import init_state, parse_gpu_spec
    from slurm_mig.store import open_store

    assert [ascii_digits(t) for t in ("0", "042", "", "²", "٣", "-1", " 1", "1.0")] == [True, True] + [False] * 6
    sim = tmp_path / "sim.json"
    init_state(sim, parse_gpu_spec("H100-80GB:2"))
    if where == "db_group":
        with pytest.raises(StoreError, match="group '²' does not exist"):
            open_store(tmp_path / "state.db", group="²")
        return
    argv = {"sim-busy instance": ["nvml", "sim-busy", "--sim-state", str(sim), "--gpu", "0", "3g@²", "--owner", "j"],
            "simulate --milli-map": ["simulate", "--trace", str(tmp_path / "t.csv"), "--milli-map", "1g:142,7g:²000"],
            "sim-init --gpus": ["nvml", "sim-init", "--sim-state", str(sim), "--force", "--gpus", "H100-80GB:²"],
            "sim-init --layout": ["nvml", "sim-init", "--sim-state", str(sim), "--force", "--gpus", "H100-80GB:2",
                                  "--layout", "²=7g@0"]}[where]
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("slurm-mig: error: bad ") and "²" in err, err
