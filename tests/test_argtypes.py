"""Command-line numbers are checked where they are given: a float flag took nan, inf and negatives, which
failed far from the flag (``time.sleep(-1)`` after a first round of ``node sync --loop``, a demo that never
gives up) or spun (``top --interval 0``)."""

from __future__ import annotations

import argparse

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
