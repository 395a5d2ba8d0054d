"""`slurm-mig status | jobs | nodes | decisions | explain | top` through the real command line."""

from __future__ import annotations

import contextlib
import json

import pytest

from slurm_mig.cli import main
from slurm_mig.ops import fmt as F
from slurm_mig.store import open_store
from tests.helpers import raw_answer_server
from slurm_mig.policies.base import Decision
from tests.test_ops_views import NOW, build_state


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    import slurm_mig.ops.views as V

    db = tmp_path / "state.db"
    with open_store(db) as s:
        build_state(s)
    path = tmp_path / "slurm-mig.toml"
    # listen_port 1: /healthz never answers, so `status` shows the API as down (no controller runs here).
    path.write_text(f'[controller]\ndb_path = "{db}"\ntick_interval_s = 5.0\nlisten_port = 1\n')
    monkeypatch.setattr(V.time, "time", lambda: NOW)  # the state was written "now"
    return str(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_status_text_json_and_check(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "status")
    assert rc == 0
    assert "controller  api-down" in out
    # said once ("/healthz does not answer; /healthz NOT answering" said it twice)
    assert out.splitlines()[0].count("/healthz") == 1 and "; /healthz does not answer)" in out
    assert "nodes       3 with GPUs: 1 stale, 2 up   (no GPUs: capacity)" in out
    assert "queue       3 pending, 3 running; oldest pending: job 201 (1 x 7g)" in out
    assert "#1 gpu02/0 3g@0,3g@4 -> 7g@0 in_progress" in out.replace("  #", "#")
    rc, out, _ = run(capsys, "--config", cfg, "status", "--json", "--no-probe")
    data = json.loads(out)
    assert data["controller"]["state"] == "ok" and data["jobs"]["pending"] == 3
    rc, _, _ = run(capsys, "--config", cfg, "status", "--check", "--no-probe")
    assert rc == 1  # gpu03 is stale


def test_jobs(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "jobs")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:5] == ["JOB", "USER", "PARTITION", "WANTS", "STATE"]
    assert [line.split()[0] for line in lines[1:]] == ["201", "202", "203", "101", "102", "103"]
    assert "gpu01:3g@0/0" in out and "2x1g" in out
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "pending", "--json")
    assert [j["job_id"] for j in json.loads(out)] == ["201", "202", "203"]
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "done")
    assert out.strip() == "no jobs"
    rc, _, err = run(capsys, "--config", cfg, "jobs", "--state", "bogus")
    assert rc == 2 and "unknown state BOGUS" in err


def test_jobs_and_explain_json_give_the_exit_status_as_sacct_does_beside_the_raw_one(cfg, capsys, tmp_path):
    # The raw field is the wait status (768 for `exit 3`); text output and sacct say "3:0".
    with open_store(tmp_path / "state.db") as s:
        s.upsert_job("301", profile="1g", user="alice", now=NOW - 60)
        s.set_job_state("301", "RUNNING", now=NOW - 50, node="gpu01")
        s.set_job_state("301", "FAILED", now=NOW - 10, exit_code=768)
        s.record_outcome("301", state="FAILED", exit_code=768, now=NOW - 10)
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "done", "--json")
    assert rc == 0 and [(j["exit_code"], j["exit"]) for j in json.loads(out)] == [(768, "3:0")]
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "pending", "--json")
    assert {j["exit"] for j in json.loads(out)} == {None}  # not ended: no status, not "unknown"
    rc, out, _ = run(capsys, "--config", cfg, "explain", "301", "--json")
    data = json.loads(out)
    assert data["job"]["exit"] == data["outcome"]["exit"] == "3:0" and data["outcome"]["exit_code"] == 768


def test_jobs_json_says_which_run_of_a_reused_job_id_a_row_is(cfg, capsys, tmp_path):
    # `explain` said "outcome (run 2 of this id)"; `jobs --json` gave the row without its run.
    with open_store(tmp_path / "state.db") as s:
        s.upsert_job("302", profile="1g", user="alice", now=NOW - 600)
        s.set_job_state("302", "RUNNING", now=NOW - 590, node="gpu01")
        s.record_outcome("302", state="COMPLETED", exit_code=0, now=NOW - 500)
        s.set_job_state("302", "COMPLETED", now=NOW - 500, exit_code=0)
        s.restart_job("302", now=NOW - 100, reason="live in Slurm again", submit_time=NOW - 100)
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "all", "--json")
    assert rc == 0 and [(j["job_id"], j["run"]) for j in json.loads(out) if j["job_id"] == "302"] == [("302", 2)]


def test_nodes(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "nodes", "--width", "100")
    assert rc == 0
    assert "gpu01  up" in out and "gpu03  stale" in out and "capacity  drain" in out
    assert "layout 3g@0,2g@4,1g@6" in out and "[3g·job101·alice" in out
    assert "desired 7g@0" in out and "reconfiguration #1 in_progress 1/3 steps -> 7g@0" in out
    rc, out, _ = run(capsys, "--config", cfg, "nodes", "--node", "gpu02", "--json")
    nodes = json.loads(out)
    assert [n["name"] for n in nodes] == ["gpu02"] and len(nodes[0]["gpus"]) == 2


def test_nodes_and_top_name_the_jobs_a_gpu_is_held_for(cfg, capsys, tmp_path):
    """A region the policy holds for a waiting job keeps its instances from Slurm's counts, busy ones too where
    no instance of their size is idle elsewhere on the node: `scontrol show node` then shows fewer of a size
    than GresUsed. `nodes` and `top` say which job the GPU is held for."""
    from slurm_mig.ops import render as R
    from slurm_mig.ops import views as V

    with open_store(tmp_path / "state.db") as s:
        s.set_meta("held", {"203": [["gpu01", 0, 0x0F, [], []]], "202": [["gpu02", 1, 0xFF, [], []]]})
    rc, out, _ = run(capsys, "--config", cfg, "nodes", "--node", "gpu01", "--width", "140")
    assert rc == 0 and "held for job 203" in out, out
    rc, out, _ = run(capsys, "--config", cfg, "nodes", "--json")
    held = {(n["name"], g["gpu"]): g["held_for"] for n in json.loads(out) for g in n["gpus"]}
    assert held[("gpu01", 0)] == ["203"] and held[("gpu02", 1)] == ["202"], held
    assert not held[("gpu01", 1)]
    with open_store(tmp_path / "state.db") as s:
        snap = V.load_snapshot(s, now=NOW)
    lines = [str(t) for t in R.gpu_lines(V.node_views(snap, nodes="gpu01"), 100, R.Glyphs(ascii_only=True))]
    assert lines[0].endswith(" held:203") and "held" not in lines[1], lines


@pytest.mark.parametrize("value", ['{"203": [["gpu01", Infinity, 15, [], []]]}', '{"203": [["gpu01", -Infinity, 15]]}',
                                   "not json", '{"203": [["gpu01", NaN, 15]], "202": [null]}', '[1, 2]'])
def test_nodes_and_top_with_a_damaged_held_row(cfg, capsys, tmp_path, value):
    """The meta row "held" edited by hand or damaged (tests/test_ops_odd_values.py): no GPU is shown held for it,
    and the commands still answer. A GPU index of Infinity (json reads it as a float) raised OverflowError out of
    every view, and a row that is not JSON JSONDecodeError."""
    import sqlite3

    with open_store(tmp_path / "state.db") as s:
        s.set_meta("held", {})
    db = sqlite3.connect(tmp_path / "state.db")
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'held'", (value,))
    db.close()
    for argv in (["nodes"], ["nodes", "--json"], ["top", "--once", "--width", "120", "--height", "40"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0 and "held" not in out.replace('"held_for": []', ""), (argv, out, err)


def test_decisions(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "decisions")
    assert rc == 0 and out.startswith("#4 ")
    assert "re-carve gpu02/0 -> 7g@0: carve instances for pending jobs" in out
    assert "job 201 -> gpu02 (7g.80gb@0 GPU 0): carved gpu02/0:7g.80gb@0" in out
    assert "job 203 waits: no node can hold 1 x 4g on idle slices now" in out
    rc, out, _ = run(capsys, "--config", cfg, "decisions", "--waiting", "--json")
    assert [d["id"] for d in json.loads(out)] == [4, 2, 1]
    rc, out, _ = run(capsys, "--config", cfg, "decisions", "--all", "--limit", "2", "--json")
    assert [d["id"] for d in json.loads(out)] == [5, 4]
    rc, out, _ = run(capsys, "--config", cfg, "decisions", "--job", "202")
    assert "job 202 waits: behind a higher-priority job" in out and "job 203 waits" not in out


def test_decisions_at_a_large_site_print_a_bounded_list_per_decision(cfg, capsys, monkeypatch):
    """One decision at 1,024 GPUs placed hundreds of jobs and `decisions` (10 decisions by default) printed
    2,819 lines: each list of a decision is cut at DECISION_LINES, saying how many more; --job shows that job's
    placement alone; --json keeps every one."""
    import slurm_mig.ops.views as V
    from slurm_mig.ops.cli import DECISION_LINES

    real = V.decisions_view

    def big(store, **kw):
        [d] = real(store, **{**kw, "limit": 1, "job_id": None})
        inst = [{"gpu": 0, "profile": "1g.10gb", "start": 0}]
        d = {**d, "changes": [{"node": f"g{k}", "gpu": 0, "target": "1g@0", "reason": "r"} for k in range(25)],
             "assignments": [{"job_id": str(900 + k), "node": f"g{k}", "instances": inst, "reason": "p"}
                             for k in range(300)]}
        return [d]

    monkeypatch.setattr(V, "decisions_view", big)
    rc, out, _ = run(capsys, "--config", cfg, "decisions")
    assert rc == 0 and len(out.splitlines()) < 2 * DECISION_LINES + 10, len(out.splitlines())
    assert f"... {25 - DECISION_LINES} more re-carves (--json lists every one)" in out
    assert f"... {300 - DECISION_LINES} more placed (--json lists every one)" in out
    rc, out, _ = run(capsys, "--config", cfg, "decisions", "--job", "1150")
    assert "job 1150 -> g250" in out and "job 900 ->" not in out and "more placed" not in out
    rc, out, _ = run(capsys, "--config", cfg, "decisions", "--json")
    assert len(json.loads(out)[0]["assignments"]) == 300


def test_explain(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "explain", "201", "--width", "120")
    assert rc == 0
    assert out.startswith("Job 201, user dave, partition gpu, asks for 1 x 7g: PENDING")
    assert "In short: job 201 (1 x 7g) is PENDING, waiting 5m00s" in out
    assert "#1..#2 (2 decisions, first-fit 2) waiting: no node can hold 1 x 7g on idle slices now" in out
    assert "placed on gpu02 GPU 0 7g.80gb@0: carved gpu02/0:7g.80gb@0" in out
    assert "What the policy saw at decision #1 (first wait" in out
    assert "this job was number 1 in the queue" in out
    assert "chosen gpu02/0" in out
    assert "gpu01/1" in out and "no room for 7g: busy 7g.80gb@0" in out
    assert "#1 " in out and "gpu02/0 3g@0,3g@4 -> 7g@0: in_progress" in out
    assert "Timeline of gpu02 GPU 0" in out and "queue" in out
    rc, out, _ = run(capsys, "--config", cfg, "explain", "103", "--json")
    data = json.loads(out)
    assert data["job"]["node"] == "gpu01" and data["timeline"]["segments"]
    rc, _, err = run(capsys, "--config", cfg, "explain", "999")
    assert rc != 0 and "no record of job 999" in err


def test_explain_says_which_run_of_a_reused_job_id_the_outcome_is(cfg, tmp_path, capsys):
    # Job 301 ran, ended, and its id is live again (reused, or requeued after it ended).
    with open_store(tmp_path / "state.db") as s:
        s.upsert_job("301", profile="1g", submit_time=NOW - 900, now=NOW - 900)
        s.set_job_state("301", "RUNNING", now=NOW - 800, node="gpu01")
        s.record_outcome("301", state="COMPLETED", exit_code=0, end_time=NOW - 700, now=NOW - 700)
        s.set_job_state("301", "COMPLETED", now=NOW - 700, exit_code=0)
        s.restart_job("301", now=NOW - 600, reason="live in Slurm again")
    rc, out, _ = run(capsys, "--config", cfg, "explain", "301")
    assert rc == 0 and "outcome of an earlier run of this id (run 1): COMPLETED, exit code 0:0" in out
    with open_store(tmp_path / "state.db") as s:
        s.set_job_state("301", "RUNNING", now=NOW - 500, node="gpu01")
        s.record_outcome("301", state="FAILED", exit_code=256, end_time=NOW - 100, now=NOW - 100)
        s.set_job_state("301", "FAILED", now=NOW - 100, exit_code=256)
    rc, out, _ = run(capsys, "--config", cfg, "explain", "301")
    assert rc == 0 and "outcome (run 2 of this id): FAILED, exit code 1:0" in out
    rc, out, _ = run(capsys, "--config", cfg, "explain", "301", "--json")
    o = json.loads(out)["outcome"]
    assert (o["state"], o["run_s"], o["run"], o["earlier_run"]) == ("FAILED", 400.0, 2, False)


def test_explain_replay(cfg, capsys):
    pytest.importorskip("slurm_mig.sim.engine")
    rc, out, _ = run(capsys, "--config", cfg, "explain", "201", "--replay", "--width", "100")
    assert rc == 0 and "Replay in the simulator (approximate:" in out
    assert "simulated wait" in out or "never started" in out or "Replay: " in out


def test_top_once(cfg, capsys):
    rc, out, _ = run(capsys, "--config", cfg, "top", "--once", "--width", "80", "--height", "24")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 24 and all(len(x) <= 80 for x in lines)
    for word in ("gpu01", "gpu02", "gpu03", "201", "202", "203", "[3g·job101·alice"):
        assert word in out
    rc, out, _ = run(capsys, "--config", cfg, "top", "--once", "--view", "summary", "--ascii")
    assert "Instances by profile" in out and all(ord(c) < 128 for c in out)


@pytest.mark.parametrize("args,said", [(["top", "--once", "--width", "-5"], "-5 is too small (at least 10)"),
                                       (["top", "--once", "--height", "11"], "11 is too small (at least 12)"),
                                       (["nodes", "--width", "x"], "'x' is not a whole number")])
def test_a_frame_too_small_to_show_anything_is_refused(cfg, capsys, args, said):
    """`top --once --width -5` printed nothing and exited 0 (noticed in review)."""
    with pytest.raises(SystemExit) as exc:
        run(capsys, "--config", cfg, *args)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_missing_database_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(f'[controller]\ndb_path = "{tmp_path}/none.db"\n')
    rc, out, err = run(capsys, "--config", str(path), "status")
    assert rc != 0 and "no state database at" in err and "controller running" in err
    assert not (tmp_path / "none.db").exists()


def test_db_flag_reads_a_copy(cfg, tmp_path, capsys):
    rc, out, _ = run(capsys, "status", "--db", str(tmp_path / "state.db"), "--json")
    assert rc == 0 and json.loads(out)["gpus"]["total"] == 5


EVIL = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\x7f\rhidden\nfake line"


def test_text_output_escapes_control_characters_from_user_fields(cfg, capsys):
    """`sbatch -J` (and Slurm's reason, the event log) reach the operator's terminal: none may drive it."""
    import tomllib

    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    with open_store(db) as s:
        s.upsert_job("204", profile="1g", user="mal" + EVIL, name="n" + EVIL, partition="p" + EVIL,
                     submit_time=NOW - 5, now=NOW - 5)
        s.set_job_state("204", "PENDING", reason="r" + EVIL, now=NOW - 4)
        s.add_event("requeue", "job 204 " + EVIL, now=NOW - 3)
    outs = {}
    for argv in (["status", "--no-probe"], ["jobs"], ["nodes"], ["decisions", "--all", "--waiting"],
                 ["explain", "204"], ["top", "--once", "--width", "120", "--height", "40"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0, (argv, err)
        bad = [c for c in out if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]
        assert not bad, (argv, bad)
        outs[argv[0]] = out
    assert "n\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m\\x7f\\x0dhidden\\x0afake line" in outs["explain"]  # nothing lost
    assert "mal\\x1b]0;" in outs["jobs"]
    assert "job 204 \\x1b]0;" in outs["top"]
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "pending", "--json")
    assert [j["user"] for j in json.loads(out) if j["job_id"] == "204"] == ["mal" + EVIL]  # JSON keeps the value


def test_config_is_accepted_after_the_command(cfg, capsys):
    # The operator guide says the commands take `--config PATH`; `slurm-mig status --config PATH` was
    # refused ("unrecognized arguments") because only `slurm-mig --config PATH status` was parsed.
    for argv in (["status", "--no-probe", "--json", "--config", cfg], ["jobs", "--config", cfg, "--json"],
                 ["nodes", "--json", "--config", cfg], ["decisions", "--config", cfg, "--json"],
                 ["explain", "201", "--config", cfg, "--json"],
                 ["top", "--once", "--config", cfg, "--width", "80", "--height", "24"]):
        rc, out, err = run(capsys, *argv)
        assert rc == 0, (argv, err)
        assert out.strip()
    # Given before the command it still counts (the subcommand's default does not overwrite it).
    rc, out, _ = run(capsys, "--config", cfg, "status", "--no-probe", "--json")
    assert rc == 0 and json.loads(out)["jobs"]["pending"] == 3


def test_partition_when_sinfo_fails_is_an_error_not_an_empty_cluster(cfg, capsys, monkeypatch):
    # `nodes --partition P` printed "no nodes match" (or `[]` with --json) and exited 0, and `top
    # --partition P` drew "no GPUs reported yet", when sinfo could not be run: Slurm's failure read as an
    # empty partition.
    from types import SimpleNamespace

    from slurm_mig.slurm import runner

    answer = {"nodes": None}
    monkeypatch.setattr(runner.SlurmClient, "from_config",
                        classmethod(lambda cls, cfg: SimpleNamespace(nodes=lambda: answer["nodes"])))
    for argv in (["nodes", "--partition", "gpu"], ["nodes", "--partition", "gpu", "--json"],
                 ["top", "--once", "--partition", "gpu", "--width", "80", "--height", "24"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc != 0 and out == "", argv
        assert "--partition gpu: cannot ask Slurm which nodes it has" in err
    # When sinfo answers, the partition's nodes are shown.
    answer["nodes"] = [SimpleNamespace(name="gpu02", partitions=("gpu",)),
                       SimpleNamespace(name="gpu03", partitions=("big",))]
    rc, out, _ = run(capsys, "--config", cfg, "nodes", "--partition", "gpu", "--json")
    assert rc == 0 and [n["name"] for n in json.loads(out)] == ["gpu02"]
    rc, out, _ = run(capsys, "--config", cfg, "top", "--once", "--partition", "gpu", "--width", "80",
                     "--height", "24")
    starts = [line.split(" ", 1)[0] for line in out.splitlines()]
    assert rc == 0 and "gpu02" in starts and "gpu03" not in starts


def test_jobs_nodes_explain_say_when_the_controller_is_not_ticking(cfg, capsys, monkeypatch):
    # With the controller down an hour, `jobs` listed the queue with waits and run times counted up to
    # now and nothing said it was an hour-old picture; `status` and `top` said "stale", these did not.
    import slurm_mig.ops.views as V

    for argv in (["jobs"], ["nodes"], ["explain", "201"]):
        rc, _, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0 and "note: controller" not in err, argv  # fresh: nothing said
    monkeypatch.setattr(V.time, "time", lambda: NOW + 3600)
    for argv in (["jobs"], ["jobs", "--json"], ["nodes", "--json"], ["explain", "201"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0, argv
        assert "slurm-mig: note: controller stale (last tick 1h00m ago" in err, argv
        if "--json" in argv:
            json.loads(out)  # the note is on stderr: stdout stays JSON


def test_top_with_a_node_filter_that_matches_nothing_says_so(cfg, capsys):
    """`top --node nosuch` blamed the node agents ("no GPUs reported yet (are the node agents running?)")
    for what is a filter that matches no node."""
    rc, out, _ = run(capsys, "--config", cfg, "top", "--once", "--node", "nosuch", "--width", "100", "--height", "24")
    assert rc == 0 and "no nodes match node=nosuch" in out and "agents running" not in out


def test_status_prints_at_most_decision_lines_open_reconfigurations_then_how_many_more(cfg, capsys, tmp_path):
    """A large site has a hundred reconfigurations open at once, and status printed a line for each (110 at
    1,024 GPUs and 10,000 pending in benchmarks/ops_scale.py). It prints the oldest DECISION_LINES and how many
    more, as `decisions` cuts its lists; --json lists every one."""
    from slurm_mig.ops.cli import DECISION_LINES

    db = tmp_path / "state.db"
    with open_store(db) as s:
        for k in range(30):
            s.journal_begin(f"gpu{10 + k}", 0, "7g@0", "3g@0,3g@4", [{"action": "destroy", "profile": "7g.80gb",
                                                                       "start": 0}], started=False, now=NOW - 5)
    rc, out, _ = run(capsys, "--config", cfg, "status", "--no-probe")
    shown = [line for line in out.splitlines() if line.startswith("  #")]
    assert rc == 0 and len(shown) == DECISION_LINES, len(shown)  # was 31
    assert shown[0].startswith("  #1 gpu02/0")  # the oldest first
    assert f"  ... {31 - DECISION_LINES} more (`slurm-mig nodes` shows each GPU's; --json lists every one)" in out
    rc, out, _ = run(capsys, "--config", cfg, "status", "--json", "--no-probe")
    assert len(json.loads(out)["reconfigurations"]) == 31


def test_status_check_fails_on_a_lost_gpu(cfg, capsys, tmp_path):
    """A GPU that fell off the bus (NVML GPU_IS_LOST) leaves its node up in Slurm: `status` said "1 LOST" but
    `status --check`, the cron / Nagios check, exited 0, so nothing that watched it learned of the fault."""
    from slurm_mig.store.models import LOST_REASON

    gpu = {"gpu": 0, "model": "H100-80GB", "mig_enabled": True, "uuid": "GPU-0"}
    with open_store(tmp_path / "state.db") as s:  # gpu03 reports afresh: nothing is wrong
        s.replace_observed("gpu03", [gpu], [], now=NOW - 1)
    assert run(capsys, "--config", cfg, "status", "--check", "--no-probe")[0] == 0
    with open_store(tmp_path / "state.db") as s:  # then its GPU falls off the bus
        s.replace_observed("gpu03", [dict(gpu, mig_enabled=False, blocked=LOST_REASON)], [], now=NOW)
    rc, out, _ = run(capsys, "--config", cfg, "status", "--check", "--no-probe")
    assert rc == 1 and "1 LOST" in out, out
    rc, out, _ = run(capsys, "--config", cfg, "status", "--check", "--no-probe", "--json")
    assert rc == 1 and json.loads(out)["gpus"]["lost"] == 1


@pytest.mark.parametrize("value", ["not json", "[1, 2]", '{"201": 5}'])
def test_status_jobs_and_top_with_a_damaged_reservations_row(cfg, capsys, tmp_path, value):
    """The meta row "reservations" edited by hand or damaged: no job is shown reserved for it, and the commands
    still answer (a row that is not JSON raised JSONDecodeError out of load_tick, a list AttributeError)."""
    import sqlite3

    db = sqlite3.connect(tmp_path / "state.db")
    with db:
        db.execute("INSERT OR REPLACE INTO meta (key, value, updated_at) VALUES ('reservations', ?, ?)", (value, NOW))
    db.close()
    for argv in (["status", "--no-probe"], ["jobs", "--json"], ["top", "--once", "--width", "120", "--height", "40"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0 and "Traceback" not in err, (argv, out, err)
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "pending", "--json")
    assert {json.dumps(j["reserved"]) for j in json.loads(out)} == {"null"}, out


def test_a_requeued_job_waiting_again_reads_as_waiting_with_its_earlier_placement_labelled(tmp_path, capsys):
    """A running job requeued (by an admin, or Slurm after its node went down) waits again, held back by Slurm:
    `jobs` still showed it on its first placement (WHERE n1:1g@0/0) and `explain` said "PENDING on n1 GPU 0
    1g.10gb@0", as though it held that instance. It holds nothing now; the placement is its earlier attempt's."""
    import time as _time

    from slurm_mig.config import Config
    from slurm_mig.controller.service import Controller
    from slurm_mig.ops import views as V
    from slurm_mig.ops.explain import explain_view
    from slurm_mig.slurm.parsers import SlurmJob, SlurmNode

    class Requeued:
        queue: list = []

        def jobs(self):
            return list(self.queue)

        def nodes(self):
            return [SlurmNode(name="n1", state="idle", gres={}, gres_used={})]

        def reservations(self):
            return []

        def job_detail(self, job_id):
            return None

        def update_node_gres(self, node, counts, **kw):
            return ""

    now = _time.time()
    db = tmp_path / "requeue.db"
    store = open_store(db)
    try:
        ctl = Controller(Config(), store, Requeued())
        store.upsert_job("7", profile="1g", user="alice", submit_time=now - 400, now=now - 400)
        store.bind("7", "n1", [{"gpu": 0, "profile": "1g.10gb", "start": 0}], now=now - 300)
        store.set_job_state("7", "RUNNING", now=now - 300, node="n1")
        # `scontrol requeue 7`: Slurm lists it waiting, restarted once, held back (BeginTime) for cred_expire.
        ctl.slurm.queue = [SlurmJob(job_id=7, state="PENDING", state_reason="BeginTime", user="alice",
                                    mig={"1g": 1}, tres_per_node="gres:mig:1g:1", submit_time=int(now - 2),
                                    restart_cnt=1, priority=1)]
        ctl.tick()
        assert store.get_job("7").state == "PENDING" and not store.bound_instances("7")
        (j,) = [j for j in V.jobs_view(store, now=now) if j["job_id"] == "7"]
        assert (j["state"], j["node"], j["instances"]) == ("PENDING", None, [])
        assert j["previous_attempt"] == {"node": "n1", "instances": [
            {"gpu": 0, "profile": "1g.10gb", "start": 0, "uuid": None}]}
        ex = explain_view(store, "7", now=now)
        assert (ex["job"]["node"], ex["job"]["instances"]) == (None, [])
        assert ex["job"]["previous_attempt"]["node"] == "n1"
        # A job that ran and still runs keeps its placement, with no earlier attempt.
        store.upsert_job("8", profile="1g", user="bob", submit_time=now - 100, now=now - 100)
        store.bind("8", "n1", [{"gpu": 0, "profile": "1g.10gb", "start": 1}], now=now - 50)
        store.set_job_state("8", "RUNNING", now=now - 50, node="n1")
        (j8,) = [j for j in V.jobs_view(store, now=now) if j["job_id"] == "8"]
        assert (j8["node"], j8["previous_attempt"]) == ("n1", None) and j8["instances"]
    finally:
        store.close()
    cfg = tmp_path / "requeue.toml"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\ntick_interval_s = 5.0\nlisten_port = 1\n')
    rc, out, _ = run(capsys, "--config", str(cfg), "jobs")
    (line,) = [ln for ln in out.splitlines() if ln.split()[:1] == ["7"]]
    assert rc == 0 and "n1:" not in line and "PENDING" in line
    rc, out, _ = run(capsys, "--config", str(cfg), "explain", "7", "--width", "200")
    head = out.splitlines()[0]
    assert rc == 0 and head.endswith("asks for 1 x 1g: PENDING"), head
    assert "earlier attempt (before its requeue) ran on n1 GPU 0 1g.10gb@0" in out


@pytest.mark.parametrize("answer", [b"\x00\xffnot http at all\r\n\r\n",  # http.client.BadStatusLine
                                    b"HTTP/1.1 200 " + b"x" * 70_000 + b"\r\n\r\n"])  # http.client.LineTooLong
def test_status_and_top_survive_a_controller_port_that_answers_garbage(tmp_path, capsys, answer):
    """Something else on [controller].listen_port (or a controller dying mid-answer): `status` and `top --once`
    printed http.client's BadStatusLine / LineTooLong traceback, as probe_healthz caught OSError only."""
    with raw_answer_server(answer) as port:
        _assert_api_down_in_status_and_top(tmp_path, capsys, f"listen_port = {port}")


@pytest.mark.parametrize("host", ["head-node:7677", "0.0.0.0:7677"])
def test_status_with_a_listen_host_that_is_host_colon_port(tmp_path, capsys, host):
    """listen_host = "head-node:7677" is taken by the config (the controller refuses it at its start, naming
    the key); `status` and `top --once` bracketed it as an IPv6 address and printed urllib's ValueError
    traceback. Now /healthz simply does not answer."""
    _assert_api_down_in_status_and_top(tmp_path, capsys, f'listen_host = "{host}"')


def _assert_api_down_in_status_and_top(tmp_path, capsys, controller_setting: str) -> None:
    """`status` and `top --once` on a state DB, with [controller] ``controller_setting``: both answer, saying the
    controller's API is down (no traceback)."""
    db = tmp_path / "state.db"
    with open_store(db) as s:
        build_state(s)
    path = tmp_path / "slurm-mig.toml"
    path.write_text(f'[controller]\ndb_path = "{db}"\n{controller_setting}\n')
    rc, out, _ = run(capsys, "--config", str(path), "status")
    assert rc == 0 and "/healthz does not answer" in out.splitlines()[0]
    rc, out, _ = run(capsys, "--config", str(path), "top", "--once")
    assert rc == 0 and "API DOWN" in out.splitlines()[0]


@pytest.mark.parametrize("argv", [["decisions", "--limit"], ["jobs", "--limit"], ["top", "--once", "--page"]])
def test_a_count_past_64_bits_is_refused_where_given(cfg, capsys, argv):
    """`decisions --limit 99999999999999999999999` printed sqlite3's "OverflowError: Python int too large to
    convert to SQLite INTEGER" traceback: argtypes.at_least had no upper bound. Counts stop at 2**63 - 1."""
    with pytest.raises(SystemExit) as exc:
        main(["--config", cfg, *argv, "9" * 23])
    assert exc.value.code == 2 and "too large" in capsys.readouterr().err
    assert run(capsys, "--config", cfg, *argv, str(2**63 - 1))[0] == 0


@pytest.mark.parametrize("spec", ["", ",", " , ,"])
def test_jobs_with_an_empty_state_list_is_an_error_not_no_jobs(cfg, capsys, spec):
    """`jobs --state "$STATES"` with the variable unset said "no jobs" (exit 0) while six were live: an
    empty list of states matched none. Found trying empty values for each ops flag."""
    rc, out, err = run(capsys, "--config", cfg, "jobs", "--state", spec)
    assert rc == 2 and out == "" and "no state given" in err


def _damaged(kind: str, path) -> bytes:
    good = path.read_bytes()
    if kind == "tables overwritten":  # all but schema_migrations, read at the open: damage found by the reads after it
        import sqlite3

        with contextlib.closing(sqlite3.connect(path)) as db:
            size = db.execute("PRAGMA page_size").fetchone()[0]
            roots = [r for (r,) in db.execute("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND "
                                              "name != 'schema_migrations'")]
        bad = bytearray(good)
        for r in roots:
            bad[(r - 1) * size:r * size] = b"\xff" * size
        return bytes(bad)
    return {"text": b"hello, not a database\n", "empty": b"", "truncated": good[:3000], "half": good[:len(good) // 2],
            "garbage after the header": good[:16] + b"\xff" * 5000}[kind]


@pytest.mark.parametrize("kind", ["text", "empty", "truncated", "half", "garbage after the header",
                                  "tables overwritten"])
def test_a_db_that_is_not_a_database_is_an_error_not_try_again_later(cfg, capsys, tmp_path, kind):
    """`--db FILE` on a text file or a damaged database exited 75 (EX_TEMPFAIL, "try again later", as for a busy
    database): SQLite's "file is not a database" / "malformed" read as StoreUnavailable. Now exit 1 as for any
    other unusable file, one line naming the file and what is wrong, and the file left as it was."""
    bad = tmp_path / "bad.db"
    bad.write_bytes(_damaged(kind, tmp_path / "state.db"))
    bad.chmod(0o600)
    before = bad.read_bytes()
    for argv in (["status"], ["jobs"], ["nodes"], ["decisions"], ["top", "--once"], ["explain", "201"]):
        rc, out, err = run(capsys, "--config", cfg, *argv, "--db", str(bad))
        assert rc == 1 and out == "", (argv, rc, err)
        assert err.count("\n") == 1 and err.startswith(f"slurm-mig: error: state database {bad} "), (argv, err)
        assert ("is empty" if kind == "empty" else "is not an SQLite database" if kind == "text"
                else "is not a usable SQLite database") in err, (argv, err)
    assert bad.read_bytes() == before
    if kind in ("text", "empty"):  # refused before SQLite opens it: not even its -wal / -shm beside it
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("bad.db")) == ["bad.db"]


@pytest.mark.parametrize("argv", [["jobs"], ["nodes"], ["top", "--once"], ["status", "--json"], ["policy", "list"],
                                  ["--help"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(cfg, tmp_path, argv):
    """`slurm-mig jobs | head -1`: the output still buffered at the end failed at the interpreter's exit ("Exception
    ignored ... BrokenPipeError" on stderr, status 120), and `nodes` and `top`, printed with rich, exited 1. Now as a
    tool killed by SIGPIPE: nothing on stderr, status 141. The pipe is closed before the command writes, so the
    case does not depend on timing; PYTHONUNBUFFERED (set where these tests ran) hid the buffered case."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    (tmp_path / "store").mkdir()  # an empty policy store: `policy list` lists the shipped default
    env.update(PYTHONPATH=str(root), SLURM_MIG_CONFIG=cfg, SLURM_MIG_POLICY_STORE=str(tmp_path / "store"))
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())",
                               *argv], stdout=write, stderr=subprocess.PIPE, env=env, cwd=root, timeout=120)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr.decode()) == (141, "")


def _status_and_top_heads(tmp_path, capsys, port: int) -> tuple[str, str]:
    path = tmp_path / f"probe-{port}.toml"
    path.write_text(f'[controller]\ndb_path = "{tmp_path / "state.db"}"\nlisten_port = {port}\n')
    rc, out, _ = run(capsys, "--config", str(path), "status")
    assert rc == 0
    status = out.splitlines()[0]
    rc, out, _ = run(capsys, "--config", str(path), "top", "--once")
    assert rc == 0
    return status, out.splitlines()[0]


OK_PAGE = b"<html><body>It works!</body></html>\n"


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(OK_PAGE), OK_PAGE),
    b"HTTP/1.0 200 OK\r\n\r\n",  # an empty 200
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok\nok"])  # "ok\n" and more
def test_healthz_is_ok_only_for_the_controllers_own_answer(cfg, tmp_path, capsys, monkeypatch, answer):
    """probe_healthz took any 200 for a live controller: a web server on [controller].listen_port, or a proxy
    ($http_proxy, which urllib used even for 127.0.0.1) answering with a page of its own, read "/healthz ok" in
    `status` and a live API in `top`. Now only the controller's answer (HEALTHZ_BODY) is, asked straight."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from slurm_mig.api import HEALTHZ_BODY
    from slurm_mig.api.auth import HmacAuth
    from slurm_mig.api.server import ApiServer
    from slurm_mig.config import Config
    from slurm_mig.controller.service import Controller
    from tests.test_security_review import _NoSlurm

    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with raw_answer_server(answer) as port:
        status, top = _status_and_top_heads(tmp_path, capsys, port)
        assert "/healthz does not answer" in status and "API DOWN" in top, (status, top)
        # Through a proxy that says what the controller says: the controller's port (1) has nothing on it. In a
        # process of its own: urlopen() reads $http_proxy once, when it first builds its opener.
        with raw_answer_server(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                               % (len(HEALTHZ_BODY), HEALTHZ_BODY)) as proxy:
            monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy}")
            path = tmp_path / "port1.toml"
            path.write_text(f'[controller]\ndb_path = "{tmp_path / "state.db"}"\nlisten_port = 1\n')
            root = Path(__file__).resolve().parents[1]
            proc = subprocess.run([sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())",
                                   "--config", str(path), "status"], capture_output=True, text=True, timeout=120,
                                  cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
            assert proc.returncode == 0 and "/healthz does not answer" in proc.stdout.splitlines()[0], proc
            # A real controller's API on the port: ok (the proxy still set).
            with open_store(tmp_path / "api.db") as store:
                ctl = Controller(Config(), store, _NoSlurm())
                srv = ApiServer("127.0.0.1", 0, HmacAuth(b"k" * 64), ctl.routes(), ctl.get_routes()).start()
                try:
                    status, top = _status_and_top_heads(tmp_path, capsys, srv.address[1])
                finally:
                    srv.stop()
            assert "; /healthz ok)" in status and "API DOWN" not in top, (status, top)


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["policy", "list"], 0),
                                       (["nvml", "show", "--sim-state", "/nonexistent/sim.json"], 1),
                                       # these asked sys.stdout.isatty() (for the width): AttributeError, 1
                                       (["jobs"], 0), (["nodes"], 0), (["decisions"], 0), (["explain", "201"], 0),
                                       (["top", "--once"], 0), (["top"], 0), (["layouts"], 0)])
def test_a_command_run_with_stdout_closed_keeps_its_exit_status(cfg, tmp_path, argv, code):
    """With file descriptor 1 closed (a cron line or a daemon's child started with `>&-`) Python sets sys.stdout to
    None and print() writes nothing. main()'s flush for the broken-pipe case (d78f39b) then raised AttributeError:
    every command, --help included, ended with a traceback and status 1, whatever its own status. The commands that
    asked sys.stdout.isatty() for their width (`jobs`, `nodes`, `decisions`, `explain`, `top`) failed so before
    d78f39b too; they ask slurm_mig.terminal.stdout_is_a_terminal() now (`top` then draws one frame, as in a pipe)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    (tmp_path / "store").mkdir()  # an empty policy store: `policy list` lists the shipped default, exit 0
    env.update(PYTHONPATH=str(root), SLURM_MIG_CONFIG=cfg, SLURM_MIG_POLICY_STORE=str(tmp_path / "store"))
    proc = subprocess.run([sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())",
                           *argv], stdout=None, stderr=subprocess.PIPE, env=env, cwd=root, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == code and "Traceback" not in proc.stderr.decode(), (proc.returncode, proc.stderr)


@pytest.mark.parametrize("argv", [["status"], ["jobs"], ["simulate"], ["policy", "retrain"]])
def test_a_db_that_is_a_fifo_is_refused_at_once_not_a_hang(cfg, tmp_path, argv):
    """`--db FIFO` blocked for ever in check_state_file's os.open (opening a FIFO for reading waits for a
    writer): `status`, `jobs` and every command reading a DB by its path hung. Opened with O_NONBLOCK now, and
    refused as not a regular file, exit 1. `simulate --db` and `policy retrain --db` said "does not exist" of it
    (Path.is_file()); they say what it is now. In a process of its own: the old code's hang is ended by the
    timeout, which kills it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "store").mkdir()
    env = {**os.environ, "PYTHONPATH": str(root), "SLURM_MIG_POLICY_STORE": str(tmp_path / "store")}
    try:
        proc = subprocess.run([sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())",
                               "--config", cfg, *argv, "--db", str(fifo)], capture_output=True, text=True,
                              env=env, cwd=root, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv} --db FIFO hung")
    assert proc.returncode == 1 and proc.stderr == f"slurm-mig: error: state database {fifo} is not a regular file\n", \
        (proc.returncode, proc.stderr)


# -- a reader who cannot make the -shm: an immutable snapshot, and a controller starting under it ------------------

_PAUSING_READER = """
import sys
sys.path.insert(0, sys.argv[1])
from slurm_mig.ops import views
real, opened = views.open_readonly, []
def pausing(*args, **kwargs):  # the real open; the first one then waits for the test's go
    store = real(*args, **kwargs)
    opened.append(getattr(store, "immutable", None))
    if len(opened) == 1:
        print("opened", flush=True)
        sys.stdin.readline()
    return store
views.open_readonly = pausing
from slurm_mig.cli import main
rc = main(sys.argv[2:])
print("opens", opened, file=sys.stderr)
sys.exit(rc)
"""


def _nobody():
    import pwd

    return pwd.getpwnam("nobody")


@pytest.fixture
def group_readable_db():
    """A state database as a controller with db_group makes it (0640, nobody's group), in a folder its readers may
    enter but not write (they cannot make the -shm): yields (db path, config path)."""
    import os
    import shutil
    import tempfile

    from tests.helpers import skip_unless_nobody_can_run_the_project

    skip_unless_nobody_can_run_the_project()
    folder = tempfile.mkdtemp(prefix="slurm-mig-ro-")  # not tmp_path (0700 root): the reader must enter it
    os.chmod(folder, 0o755)
    try:
        db = os.path.join(folder, "state.db")
        with open_store(db, group=_nobody().pw_gid) as s:
            build_state(s)
            with s.transaction():
                for i in range(400):
                    s.add_event("tick", "e" * (100 + 7 * i), node="gpu01", now=NOW)
        conf = os.path.join(folder, "slurm-mig.toml")
        with open(conf, "w") as f:
            f.write(f'[controller]\ndb_path = "{db}"\n')
        os.chmod(conf, 0o644)
        yield db, conf
    finally:
        shutil.rmtree(folder)


def _read_as_nobody_while(db: str, conf: str, argv: list[str], change) -> tuple[int, str, str]:
    """Run `slurm-mig ARGV --db DB` as nobody (in the database's group: it may read the database, not write its
    folder); once it has opened the database, run ``change()`` (a controller starting), then let it read."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    nobody = _nobody()
    child = subprocess.Popen(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              sys.executable, "-I", "-c", _PAUSING_READER, root, "--config", conf, *argv, "--db", db],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "opened\n", child.stderr.read()
        change()
        out, err = child.communicate("\n", timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err


def _controller_starts_and_prunes(db: str, *, stays_up: bool):
    """What a controller does to the file when it starts and prunes: rows deleted and written, the pages moved into
    the database file by a checkpoint (SQLite's own after 1000 pages, or at its exit). Returns the open store when
    it ``stays_up`` (the caller closes it), else None."""
    s = open_store(db, group=_nobody().pw_gid)
    with s.transaction():
        s.db.conn.execute("DELETE FROM events WHERE id % 2 = 0")
        for i in range(300):
            s.add_event("tick", "f" * (100 + 9 * i), node="gpu02", now=NOW)
            s.record_decision(Decision(waiting=(("201", "w" * (50 + 9 * i)),), policy="first-fit", version="2"),
                              latency_ms=0.1, now=NOW)
        s.db.conn.execute("DELETE FROM decisions WHERE id % 3 = 0")
        s.db.conn.execute("UPDATE jobs SET reason = ? WHERE job_id IN (SELECT job_id FROM jobs LIMIT 2)", ("r" * 3000,))
    if stays_up:
        s.db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        return s
    s.close()
    return None


@pytest.mark.parametrize("argv, stays_up", [
    (["status", "--json"], False), (["jobs", "--json"], False), (["nodes", "--json"], False),
    (["decisions", "--json"], False), (["top", "--once"], False), (["explain", "201", "--json"], False),
    (["status", "--json"], True)])
def test_a_controller_starting_under_an_immutable_reader_is_read_again_not_called_damage(group_readable_db, argv,
                                                                                          stays_up):
    """A reader in db_group cannot make the -shm while no controller is up, so it reads the file as an immutable
    snapshot. A controller that started meanwhile and changed the file under it (a prune, checkpointed) made that
    reader's next pages "database disk image is malformed": `slurm-mig status` said the database was damaged,
    exit 1 (seen in 3 of 3 runs; found by starting a controller while a reader held the file open). Now the
    command reads once more: an ordinary WAL read with the controller up, a stable file once it has gone."""
    db, conf = group_readable_db
    holder: list = []
    try:
        rc, out, err = _read_as_nobody_while(
            db, conf, argv, lambda: holder.append(_controller_starts_and_prunes(db, stays_up=stays_up)))
    finally:
        if holder and holder[0] is not None:
            holder[0].close()
    assert rc == 0 and out, (rc, err)
    assert f"opens [True, {not stays_up}]" in err, err  # the second open is a WAL read while the controller is up


def test_a_damaged_file_read_as_an_immutable_snapshot_is_still_damage(group_readable_db, tmp_path):
    """The second read is no excuse: a file damaged in earnest, read by a user who cannot make its -shm (an
    immutable snapshot both times), is still an error, exit 1, one line naming the file."""
    import os

    db, conf = group_readable_db
    with open(db, "rb") as f:
        good = f.read()
    (tmp_path / "state.db").write_bytes(good)
    damaged = _damaged("tables overwritten", tmp_path / "state.db")
    with open(db, "r+b") as f:
        f.write(damaged)
    assert os.stat(db).st_mode & 0o777 == 0o640
    rc, out, err = _read_as_nobody_while(db, conf, ["status", "--json"], lambda: None)
    assert (rc, out) == (1, ""), err
    assert err.startswith(f"slurm-mig: error: state database {db} is not a usable SQLite database "), err
    assert "opens [True, True]" in err, err


def test_one_wide_cell_does_not_push_every_jobs_reason_off_the_screen(tmp_path, capsys, monkeypatch):
    """`jobs` cropped only its last column (WHY) and let every other column be as wide as its widest cell: one job
    bound to seven 1g instances (WHERE `gpu02:1g@1/0,...,1g@1/6`, 55 cells) took the WHY column off an 80-column
    screen for every job, the pending ones' reasons included (and left it 9 cells at the 120 of a pipe). A
    column wider than its share is now cut (ending in "…") before the last column goes below its share."""
    from rich.cells import cell_len

    from slurm_mig.mig.layout import Slot
    import slurm_mig.ops.views as V
    from slurm_mig.ops import render as R

    db = tmp_path / "state.db"
    with open_store(db) as s:
        build_state(s)
        s.upsert_job("600", profile="1g", count=7, user="zoe", partition="gpu", submit_time=NOW - 50, now=NOW - 50)
        s.bind("600", "gpu02", [(1, Slot(k, "1g.10gb")) for k in range(7)], now=NOW - 40)
        s.set_job_state("600", "RUNNING", node="gpu02", now=NOW - 40)
    monkeypatch.setattr(V.time, "time", lambda: NOW)
    rc, out, _ = run(capsys, "jobs", "--db", str(db))  # to a pipe: 120 columns
    lines = out.splitlines()
    assert rc == 0 and all(cell_len(line) <= 120 for line in lines), out
    assert "no node can hold 1 x 4g" in next(line for line in lines if line.startswith("203 ")), out
    assert "gpu01:3g@0/0" in out and "gpu02:1g@1/0," in out and "…" in out  # the wide cell cut, not dropped
    # The same rows in an 80-column terminal: WHY keeps what it has without the wide cell (12 cells).
    header = lines[0].split()
    rows = [line.split(None, len(header) - 1) for line in lines[1:]]
    narrow = R.table(rows, header, 80)
    assert narrow[0].split()[-1] == "WHY" and all(cell_len(line) <= 80 for line in narrow), narrow
    assert "no node ca" in next(line for line in narrow if line.startswith("203 ")), narrow
    assert "gpu01:3g@0/0" in "\n".join(narrow)
    # The first column, the key, is never cut: a pending array's id names nothing cut short.
    rows.append(["123456_[1-1000%50]", "u" * 30, "gpu", "1g", "PENDING", "1s", "-", "-", "waits"])
    narrow = R.table(rows, header, 100)
    assert any(line.startswith("123456_[1-1000%50]  uuuuuuuuuuu…") for line in narrow), narrow
    assert all(cell_len(line) <= 100 for line in narrow) and narrow[0].split()[-1] == "WHY", narrow


# Characters that reorder or hide text though they are no control characters: a right-to-left override, an
# isolate and its end, a zero-width space, a byte-order mark, a line separator. And rich markup, which the text
# output must show as typed, not apply.
HIDDEN = "\u202eevil\u202c \u2067x\u2069 ro\u200bot \ufeff a\u2028b"
MARKUP = "[bold red]EVIL[/] [/] [link=http://x]y[/link]"


def test_text_output_shows_bidirectional_and_invisible_characters_and_markup_as_typed(cfg, capsys):
    """A job named with U+202E (RIGHT-TO-LEFT OVERRIDE) was printed as is: a terminal that does bidirectional text
    showed the rest of the line reversed (CVE-2021-42574's trick), and a zero-width space or byte-order mark in a
    user name made a user look like another (and put the table's columns out of line). They are now written as
    \\uNNNN, as control characters are written as \\xNN; rich markup in a job's fields is shown, never applied."""
    import tomllib

    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    with open_store(db) as s:
        s.upsert_job("205", profile="1g", user="u" + HIDDEN, name="n" + HIDDEN + MARKUP, partition="p" + MARKUP,
                     submit_time=NOW - 5, now=NOW - 5)
        s.set_job_state("205", "PENDING", reason="r" + HIDDEN + MARKUP, now=NOW - 4)
        s.add_event("requeue", "job 205 " + HIDDEN + MARKUP, job_id="205", now=NOW - 3)
    outs = {}
    for argv in (["jobs"], ["explain", "205"], ["top", "--once", "--width", "200", "--height", "40"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0, (argv, err)
        bad = [c for c in out if c in HIDDEN and not c.isascii()]
        assert not bad, (argv, bad)
        outs[argv[0]] = out
    shown = "\\u202eevil\\u202c \\u2067x\\u2069 ro\\u200bot \\ufeff a\\u2028b"
    assert "n" + shown + MARKUP in outs["explain"]  # nothing lost, markup as typed
    assert "u" + shown in outs["explain"] and "r\\u202eevil" in outs["jobs"]
    assert "job 205 " + shown + MARKUP in outs["explain"]
    assert "u\\u202eevil" in outs["jobs"] and "u\\u202eevil" in outs["top"] and "[bold red]EVIL[/]" in outs["top"]
    rc, out, _ = run(capsys, "--config", cfg, "jobs", "--state", "pending", "--json")
    assert [j["name"] for j in json.loads(out) if j["job_id"] == "205"] == ["n" + HIDDEN + MARKUP]  # JSON as stored


def test_tag_characters_and_other_invisible_format_characters_are_shown(cfg, capsys):
    """The tag characters (U+E0001, U+E0020-E007F) are drawn as nothing, so a user "ro" + tags + "ot" looked like
    root, as with the zero-width space 519f754 escapes; so are the interlinear annotation marks (U+FFF9-FFFB). They
    are now written as \\UNNNNNNNN / \\uNNNN too."""
    import tomllib

    from slurm_mig.controlchars import visible

    tags = "".join(chr(0xE0000 + ord(c)) for c in "xyz")
    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    with open_store(db) as s:
        s.upsert_job("206", profile="1g", user="ro" + tags + "ot", name="a\ufff9b\ufffbc", partition="gpu",
                     submit_time=NOW - 5, now=NOW - 5)
    for argv in (["jobs"], ["explain", "206"]):
        rc, out, err = run(capsys, "--config", cfg, *argv)
        assert rc == 0, (argv, err)
        assert "ro\\U000e0078" in out, (argv, out)  # (cut in the table's USER column)
        assert not [c for c in out if ord(c) >= 0xFFF9], argv
    assert "ro\\U000e0078\\U000e0079\\U000e007aot" in out and "a\\ufff9b\\ufffbc" in out
    assert visible("x" + chr(0xE0001) + chr(0x1D173)) == "x\\U000e0001\\U0001d173"


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_a_terminal_without_utf8_gets_every_command_not_a_traceback(cfg, monkeypatch, encoding):
    """With standard output in an encoding other than UTF-8 (PYTHONIOENCODING=ascii, a Latin-1 locale such as
    LANG=de_DE.ISO-8859-1 on an old head node), `jobs`, `explain` and `nodes` ended in a UnicodeEncodeError
    traceback (status 1) as soon as a job's user or name held a character the encoding lacks, and `top --once`
    and `nodes` always did (their rules, bars and ellipses). What the encoding lacks is now written as \\uNNNN
    (\\xNN), and top and nodes draw with --ascii's characters on such an output."""
    import io
    import sys
    import tomllib

    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    with open_store(db) as s:
        s.upsert_job("206", profile="1g", user="名前" * 20, name="ünï名", submit_time=NOW - 5, now=NOW - 5)
    for argv in (["jobs"], ["explain", "206"], ["nodes"], ["decisions", "--all"], ["status", "--no-probe"],
                 ["top", "--once"], ["top", "--once", "--view", "summary"]):
        raw = io.BytesIO()
        out = io.TextIOWrapper(raw, encoding=encoding, newline="\n")
        monkeypatch.setattr(sys, "stdout", out)
        rc = main(["--config", cfg, *argv])
        out.flush()
        text = raw.getvalue().decode(encoding)
        assert rc == 0, argv
        if argv[0] in ("jobs", "explain"):
            assert "\\u540d\\u524d" in text, (argv, text)  # 名前, written so
        if argv[0] in ("top", "nodes"):
            assert not any(e in text for e in ("\\u2500", "\\xb7", "\\u2192", "\\u2026")), (argv, text)  # ASCII drawing


def test_decisions_of_another_day_say_their_date(cfg, capsys):
    """`decisions` printed each decision's clock time alone (it compared the decision's day with its own): one of
    three days ago read as one of today. The controller records a decision only when it differs from the last,
    and keeps 50,000, so a quiet site's last ten span days. A decision not of today now says its date."""
    import tomllib

    from slurm_mig.mig.layout import Slot
    from slurm_mig.policies.base import Assignment, Decision

    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    old = NOW - 3 * 86400
    with open_store(db) as s:
        s.record_decision(Decision(assignments=(Assignment("101", "gpu01", ((0, Slot(0, "3g.40gb")),), "old"),),
                                   policy="first-fit", version="2"), latency_ms=0.1, now=old)
    rc, out, _ = run(capsys, "--config", cfg, "decisions")
    first, second = [line for line in out.splitlines() if line.startswith("#")][:2]
    assert first.startswith("#6 " + F.fmt_when(old, NOW) + " ") and "-" in first.split()[1], out  # MM-DD
    assert second.startswith("#4 " + F.fmt_clock(NOW - 20) + " "), out  # today's: the clock time alone


def test_the_exit_statuses_the_operator_guide_lists_are_what_the_commands_return(cfg, tmp_path, capsys):
    """The operator guide's table of exit statuses, against the commands: each status it lists that can be brought
    about here (0, 1, 2, 75) for one case it names."""
    import re
    import sqlite3
    import tomllib
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "operator-guide.md").read_text()
    table = doc[doc.index("Exit statuses of"):doc.index("| question | command |")]
    assert {int(n) for n in re.findall(r"^\| (\d+) \|", table, re.M)} == {0, 1, 2, 75, 130, 141}
    assert run(capsys, "--config", cfg, "jobs", "--state", "done")[:2] == (0, "no jobs\n")
    assert run(capsys, "--config", cfg, "explain", "999")[0] == 1
    assert run(capsys, "--config", cfg, "status", "--check", "--no-probe")[0] == 1  # gpu03 is stale
    assert run(capsys, "--config", cfg, "jobs", "--db", str(tmp_path / "none.db"))[0] == 1
    for argv in (["jobs", "--state", "bogus"], ["jobs", "--limit", "0"],
                 ["jobs", "--config", str(tmp_path / "no.toml")]):
        with pytest.raises(SystemExit) as exc:  # argparse exits; a config error returns
            code = main(["--config", cfg, *argv])
            raise SystemExit(code)
        assert exc.value.code == 2, argv
    # A writer holding the database (a copy in rollback-journal mode, where a writer's lock keeps readers out).
    db = tomllib.loads(open(cfg).read())["controller"]["db_path"]
    copy = tmp_path / "locked.db"
    copy.write_bytes(Path(db).read_bytes())
    copy.chmod(0o600)
    writer = sqlite3.connect(copy, isolation_level=None, check_same_thread=False)
    writer.execute("PRAGMA journal_mode=DELETE")
    writer.execute("BEGIN EXCLUSIVE")
    quick = tmp_path / "quick.toml"
    quick.write_text(f'[controller]\ndb_path = "{copy}"\ndb_busy_timeout_s = 0.2\nlisten_port = 1\n')
    try:
        rc, _, err = run(capsys, "--config", str(quick), "jobs")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert rc == 75, err


@pytest.mark.parametrize("flag", ["--user", "--partition", "--profile"])
@pytest.mark.parametrize("value", ["", " "])
def test_jobs_with_a_blank_filter_is_an_error_as_a_blank_state_is(cfg, capsys, flag, value):
    """`jobs --user "$U"` (or --partition, --profile) with the variable unset listed every job, exit 0, while
    `--state ""` is refused (exit 2): the blank filter was read as none. Each is refused now."""
    rc, out, err = run(capsys, "--config", cfg, "jobs", flag, value)
    assert rc == 2 and out == "" and f"no value given in {flag}" in err
    assert run(capsys, "--config", cfg, "jobs")[0] == 0

