"""benchmarks/ops_scale.py, run tiny: every operator command runs against the site's database and its time is
printed beside the 2 s budget."""

from __future__ import annotations

from tests.helpers import load_benchmark

ops = load_benchmark("ops_scale")


def test_ops_scale_runs_every_command_and_prints_it_beside_the_budget(tmp_path):
    result = ops.measure(2, 30, 10, ticks=2, runs=1, folder=tmp_path)
    assert [c["rc"] for c in result["commands"]] == [[0]] * len(ops.COMMANDS)
    by = {c["command"]: c for c in result["commands"]}
    ids = result["ids"]
    assert ids["pending"] != ids["last"] and ids["running"]
    # each printed something: the replay its simulated wait, top a whole frame
    assert all(c["stdout_bytes"] > 0 for c in result["commands"])
    assert by[f"explain {ids['pending']} --replay"]["stdout_bytes"] > by[f"explain {ids['pending']}"]["stdout_bytes"]
    lines = ops.summary_lines([result])
    assert len(lines) == len(ops.COMMANDS) + 3
    # The budget beside each; whether a command is over it is the benchmark's figure, not this test's (a loaded
    # machine took 3 s for one explain of this tiny site: a timed assertion here only measured the machine)
    assert len(result["commands"]) == len(ops.COMMANDS)
    for command, row, line in zip(ops.COMMANDS, result["commands"], lines[1:]):
        assert line.startswith(command)
        assert line.rstrip().endswith("2.0s  OVER" if row["over_budget"] else "2.0s"), line
    over = sum(row["over_budget"] for row in result["commands"])
    assert lines[-1].startswith(f"{over} of {len(ops.COMMANDS)} over the 2 s budget at 2x30x10")


def test_a_command_over_the_budget_is_flagged():
    rows = [{"command": c, "median_s": 2.5 if c == "jobs" else 0.5, "max_s": 3.0, "rc": [0], "stdout_bytes": 1,
             "over_budget": c == "jobs"} for c in ops.COMMANDS]
    result = {"nodes": 1, "pending": 2, "running": 3, "ids": {"pending": "7", "last": "8", "running": "9"},
              "commands": rows}
    lines = ops.summary_lines([result])
    assert lines[2].startswith("jobs") and lines[2].endswith("2.0s  OVER")
    assert lines[-1] == f"1 of {len(ops.COMMANDS)} over the 2 s budget at 1x2x3: jobs"


def test_churn_fills_a_long_decision_history_and_asks_about_jobs_early_late_always_and_never(tmp_path):
    result = ops.measure(2, 300, 10, ticks=2, runs=1, folder=tmp_path, churn=5, commands=ops.CHURN_COMMANDS)
    assert [c["rc"] for c in result["commands"]] == [[0]] * len(ops.CHURN_COMMANDS)
    assert result["decisions"] >= 5 + 1  # the real ticks' and the 5 recorded after them
    ids = result["ids"]
    assert len({ids[k] for k in ("early", "late", "always", "never")}) == 4
    by = {c["template"]: c for c in result["commands"]}
    assert by["decisions --job {always}"]["stdout_bytes"] > by["decisions --job {early}"]["stdout_bytes"] > 0
    lines = ops.summary_lines([result])
    assert lines[1].startswith("decisions ") and any("{early} job" in line for line in lines)
