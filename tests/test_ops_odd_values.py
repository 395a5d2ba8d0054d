"""The operator commands on a state database holding times no clock can show (1e300, infinity, huge or
negative integers): a row a person edited by hand, a copy from a broken disk, a bug. Every view says
what it can and shows such a value as "?" and the value, instead of a traceback (or, for --replay, a
simulator that never finishes)."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sqlite3

import pytest

from slurm_mig.cli import main
from slurm_mig.ops import fmt as F
from slurm_mig.ops import render as R
from slurm_mig.ops import views as V
from slurm_mig.store import open_store
from tests.test_ops_views import NOW, build_state

# Every time and duration column the views read.
TIME_COLUMNS = {
    "nodes": ["last_seen"], "gpus": ["last_observed"], "instances": ["observed_at"],
    "desired_layouts": ["decided_at"],
    "jobs": ["submit_time", "start_time", "end_time", "time_limit_s", "updated_at"],
    "bindings": ["bound_at", "released_at"], "decisions": ["time", "latency_ms"],
    "reconfig_journal": ["created_at", "started_at", "updated_at", "finished_at"],
    "outcomes": ["submit_time", "start_time", "end_time", "wait_s", "run_s", "recorded_at", "time_limit_s"],
    "events": ["time"], "meta": ["updated_at"],
}
# As SQL literals: 9e999 is infinity in SQLite (NaN cannot be stored: SQLite keeps NULL for it).
ODD = ["1e300", "-1e300", "9e999", "-9e999", "4611686018427387904", "-4611686018427387904", "-1", "0", "1e20",
       "-62135596801", "253402300800"]
# Not numbers at all, which SQLite stores as given in any column (a date a person typed, a blob from a broken
# page): TEXT and BLOB literals.
NOT_NUMBERS = ["'2026-11-27'", "X'00'", "''", "'abc'", "X''", "'2026-11-27T10:00:00Z'"]
COMMANDS = (["status", "--no-probe"], ["jobs", "--state", "all"], ["nodes"], ["decisions", "--all", "--waiting"],
            ["explain", "101"], ["explain", "103"], ["explain", "201"], ["explain", "202"],
            ["top", "--once", "--width", "120", "--height", "40"],
            ["top", "--once", "--width", "80", "--height", "24", "--view", "summary"],
            ["status", "--no-probe", "--json"], ["jobs", "--json", "--state", "all"], ["explain", "201", "--json"],
            ["explain", "201", "--replay"], ["explain", "101", "--replay"])


class Hang(BaseException):
    """(Not an Exception: the replay reports those as its error and goes on.)"""


@contextlib.contextmanager
def deadline(seconds: int):
    """A hang (a replay whose clock cannot move) fails the test instead of stopping the suite."""
    def alarm(*_):
        raise Hang(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def base(tmp_path, monkeypatch):
    db = tmp_path / "base.db"
    with open_store(db) as s:
        build_state(s)
    monkeypatch.setattr(V.time, "time", lambda: NOW)
    return db


def _config(tmp_path, db) -> str:
    path = tmp_path / f"{db.stem}.toml"
    path.write_text(f'[controller]\ndb_path = "{db}"\ntick_interval_s = 5.0\nlisten_port = 1\n')
    return str(path)


def _copy(base, tmp_path, name: str):
    db = tmp_path / f"{name}.db"
    db.write_bytes(base.read_bytes())
    return db


def _not_json(name: str):
    raise AssertionError(f"--json printed {name}, which is not JSON (jq and JavaScript refuse the document)")


def _run_all(cfg: str, capsys) -> dict[str, str]:
    outs = {}
    for argv in COMMANDS:
        with deadline(60):
            rc = main(["--config", cfg, *argv])
        out = capsys.readouterr()
        assert rc == 0, (argv, out.err)
        if "--json" in argv:
            json.loads(out.out, parse_constant=_not_json)  # standard JSON: an infinite time is null
        outs[" ".join(argv)] = out.out
    return outs


@pytest.mark.parametrize("value", ODD + NOT_NUMBERS)
def test_every_view_shows_a_database_whose_every_time_is_odd(base, tmp_path, capsys, value):
    db = _copy(base, tmp_path, "odd")
    con = sqlite3.connect(db)
    for table, cols in TIME_COLUMNS.items():
        for c in cols:
            con.execute(f"UPDATE {table} SET {c} = {value}")
    con.commit()
    con.close()
    outs = _run_all(_config(tmp_path, db), capsys)
    if value in ("1e300", "9e999", "4611686018427387904"):
        # Shown as what it is, not as a time.
        assert {"1e300": "?1e+300", "9e999": "?inf", "4611686018427387904": "?4.612e+18"}[value] \
            in outs["explain 201"], outs["explain 201"]
    if value in ("'2026-11-27'", "X'00'"):
        # Text or a blob in a time column: shown as "?" and the value too (fmt_odd), times and waits alike.
        shown = {"'2026-11-27'": "?2026-11-27", "X'00'": "?b'\\x00'"}[value]
        for argv in ("explain 201", "jobs --state all", "status --no-probe", "decisions --all --waiting"):
            assert shown in outs[argv], (argv, outs[argv])


@pytest.mark.parametrize("seed", range(6))
def test_every_view_shows_a_database_with_odd_times_here_and_there(base, tmp_path, capsys, seed):
    """Odd values mixed with real ones (a span from a real time to infinity, a wait of -1e300 s, a date typed as
    text beside numbers), in the tables and in the decisions' recorded inputs."""
    rng = random.Random(seed)
    for it in range(3):
        db = _copy(base, tmp_path, f"mix{it}")
        con = sqlite3.connect(db)
        for table, cols in TIME_COLUMNS.items():
            rows = [r[0] for r in con.execute(f"SELECT rowid FROM {table}")]
            for c in cols:
                for rowid in rows:
                    if rng.random() < 0.5:
                        con.execute(f"UPDATE {table} SET {c} = {rng.choice(ODD + NOT_NUMBERS)} WHERE rowid = ?",
                                    (rowid,))
        for did, inputs in list(con.execute("SELECT id, inputs FROM decisions")):
            if rng.random() < 0.5:
                x = json.loads(inputs or "{}")
                x["now"] = rng.choice([1e300, -1e300, float("inf"), float("nan"), 2.0 ** 62, "2026-11-27", None])
                con.execute("UPDATE decisions SET inputs = ? WHERE id = ?", (json.dumps(x), did))
        con.commit()
        con.close()
        _run_all(_config(tmp_path, db), capsys)


def test_the_formatters_show_what_is_not_a_time_as_such():
    assert F.fmt_clock(1e300) == "?1e+300" and F.fmt_when(float("inf"), NOW) == "?inf"
    assert F.fmt_when(float("nan"), NOW) == "?nan" and F.fmt_clock(2 ** 62) == "?4.612e+18"
    assert F.fmt_when(NOW, 1e300) == F.fmt_when(NOW, NOW + 86400 * 400)  # a date when today is unknown
    assert F.fmt_duration(float("inf")) == "?inf" and F.fmt_duration(1e300) == "?1e+300"
    assert F.fmt_duration(-1e300) == "0s" and F.fmt_duration(float("nan")) == "?nan"
    assert F.fmt_duration(86400 * 99_999) == "99999d00h" and F.fmt_duration(None) == "-"
    assert F.fmt_duration("x") == "?x"
    assert R.render_timeline([], 1e300, 1e300, 60) == ["no timeline: its times (?1e+300 .. ?1e+300) are not usable"]
    seg = {"gpu": "n1/0", "kind": "job", "slot": "3g@0", "t0": float("-inf"), "t1": float("inf"), "job_id": "7"}
    lines = R.render_timeline([seg], 0.0, 100.0, 40, job_id="7", submit=float("nan"), start=-1e300)
    assert any("#" * 10 in line for line in lines)


@pytest.mark.parametrize("updates, left_out", [
    # Everything arrived at an infinite time in the simulator, whose clock then could not move: `explain
    # --replay` never finished.
    ({"201": "submit_time = -9e999", "103": "time_limit_s = -9e999"}, True),
    ({"201": "submit_time = -9e999, start_time = 9e999"}, True),
    ({"201": "submit_time = 0, start_time = 1e300"}, True),
    ({"201": "submit_time = -1e300"}, False)])
def test_a_replay_of_a_job_whose_times_are_not_real_says_so_and_ends(base, tmp_path, updates, left_out):
    """A replay of a job whose own wait is not a real one is refused with why; a job whose times are not
    real is left out of another's replay; and none of them runs forever."""
    from slurm_mig.config import Config
    from slurm_mig.ops.replay import replay_job

    db = _copy(base, tmp_path, "replay")
    con = sqlite3.connect(db)
    for job_id, sql in updates.items():
        con.execute(f"UPDATE jobs SET {sql} WHERE job_id = ?", (job_id,))
    con.commit()
    con.close()
    store = V.open_readonly(db)
    policy = Config().policy.name
    try:
        with deadline(30):
            rep = replay_job(store, "201", now=NOW, policy=policy)
            assert "not times a replay can use" in rep.get("error", ""), rep
            other = replay_job(store, "202", now=NOW, policy=policy)
        assert "error" not in other, other
        assert other["jobs"] == (5 if left_out else 6)
    finally:
        store.close()


def test_every_view_shows_a_database_with_text_that_is_not_utf8(base, tmp_path, capsys):
    """SQLite keeps whatever bytes a TEXT column was given (a copy from a broken disk, a row written by another
    tool): a job's user of the byte 0xc3 alone made every command but `decisions` end with "Could not decode to
    UTF-8 column 'user'" (exit 1), one such job hiding all the others. The views now show such bytes as \\xNN,
    and --json gives them so."""
    db = _copy(base, tmp_path, "not-utf8")
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE jobs SET user = CAST(X'c3' AS TEXT), name = CAST(X'6a6f62ff' AS TEXT) "
                     "WHERE job_id IN ('101', '201')")
        conn.execute("UPDATE events SET message = CAST(X'ff20' AS TEXT)")
        conn.execute("UPDATE nodes SET health = CAST(X'fe' AS TEXT) WHERE name = 'gpu01'")
    conn.close()
    outs = _run_all(_config(tmp_path, db), capsys)
    assert "job\\xff" in outs["explain 101"] and "user \\xc3" in outs["explain 201"]
    assert "\\xc3" in outs["jobs --state all"] and "\\xfe" in outs["nodes"]
    assert [j["user"] for j in json.loads(outs["jobs --json --state all"]) if j["job_id"] == "201"] == ["\\xc3"]


def test_every_view_shows_a_database_with_bytes_that_are_not_utf8_inside_its_json(base, tmp_path, capsys):
    """The read-only opener shows a text column's bytes that are not UTF-8 as \\xNN (d40ff35); in a column holding
    JSON (a job's instances, a node's health detail, a decision's inputs and action) that \\x is no JSON escape, and
    every command but `decisions` ended in a JSONDecodeError traceback (exit 1; it said "Could not decode to UTF-8"
    before d40ff35). Such bytes in a JSON string are now read as the text \\xNN, as in any other column."""
    db = _copy(base, tmp_path, "not-utf8-json")
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE jobs SET instances = CAST(replace(instances, '\"MIG-', '\"' || X'c3' || 'MIG-') AS TEXT) "
                     "WHERE instances LIKE '%MIG-%'")
        conn.execute("UPDATE nodes SET health_detail = CAST('{\"why\": \"a\\\\b ' || X'ff' || '\"}' AS TEXT)")
        conn.execute("UPDATE decisions SET inputs = CAST(replace(inputs, '\"gpu', '\"' || X'fe' || 'gpu') AS TEXT), "
                     "action = CAST(replace(action, '\"reason\": \"', '\"reason\": \"' || X'fd') AS TEXT)")
        assert conn.execute("SELECT count(*) FROM jobs WHERE instances LIKE '%' || X'c3' || '%'").fetchone()[0]
    conn.close()
    outs = _run_all(_config(tmp_path, db), capsys)
    uuids = [i["uuid"] for j in json.loads(outs["jobs --json --state all"]) for i in j["instances"]]
    assert uuids and all(u.startswith("\\xc3MIG-") for u in uuids), uuids
    with V.open_readonly(db) as store:  # a legitimate escape beside the byte is kept as it was
        assert {n.name: n.health_detail for n in store.nodes()}["gpu01"] == {"why": "a\\b \\xff"}
