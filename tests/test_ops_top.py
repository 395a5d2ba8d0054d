"""The `top` dashboard frame and the text renderers: everything must fit 80x24 and say what it must."""

from __future__ import annotations

import random
import time

import pytest

from slurm_mig.mig.layout import Slot
from slurm_mig.ops import render as R
from slurm_mig.ops import top as T
from slurm_mig.ops import views as V
from slurm_mig.store import open_store
from tests.test_ops_views import NOW, build_state


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "state.db") as s:
        build_state(s)
    ro = V.open_readonly(tmp_path / "state.db")
    yield ro
    ro.close()


def frame(store, **opts) -> T.Frame:
    snap = V.load_snapshot(store, now=NOW, stale_after_s=120)
    return T.build_frame(snap, T.TopOptions(**{"tick_interval_s": 5, **opts}))


def assert_fits(f: T.Frame, width: int, height: int) -> None:
    assert len(f.lines) == height
    for line in f.lines:
        assert line.cell_len <= width, line.plain


def gpu_line(text: str, node: str, gpu: int) -> str:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(node + " "):
            for cand in lines[i:]:
                parts = cand[len(node) + 6:].split()
                if parts and parts[0] == str(gpu):
                    return cand
    raise AssertionError(f"no line for {node}/{gpu} in\n{text}")


def test_frame_at_80x24_shows_every_node_gpu_layout_and_pending_job(store):
    f = frame(store)
    assert_fits(f, 80, 24)
    text = f.plain()
    assert f.mode == "gpus" and f.pages == 1
    for node in ("gpu01", "gpu02", "gpu03"):
        assert node in text
    assert "no GPUs: capacity" in text
    # Each GPU line draws its instances left to right, with job and user where they fit.
    line = gpu_line(text, "gpu01", 0)
    assert line.index("[3g·job101·alice") < line.index("[2g idle") < line.index("[1g")
    assert "[7g·job103·carol" in gpu_line(text, "gpu01", 1)
    line = gpu_line(text, "gpu02", 0)
    # 3g@0 is gone, 3g@4 is being destroyed, 7g@0 is being created over both.
    assert line.index("[+7g creating") < line.index("[3g destroy") and line.endswith("→7g@0")
    assert gpu_line(text, "gpu02", 1).count("[1g") == 7
    assert "[4g idle" in gpu_line(text, "gpu03", 0) and "[3g idle" in gpu_line(text, "gpu03", 0)
    # The queue: every pending job, its profile, wait and reason.
    for job, wants in (("201", "7g"), ("202", "2x1g"), ("203", "4g")):
        row = next(line for line in text.splitlines() if line.startswith(job + " "))
        assert wants in row
    assert "5m00s" in text and "Pending 3" in text and "7gx1 5m00s" in text
    # Health: controller ticking; the stale node named in the header.
    assert "controller ok" in f.lines[0].plain
    assert "gpu03 stale" in f.lines[1].plain and "nodes 2/3 up" in f.lines[1].plain
    assert "Recent decisions and reconfigurations" in text
    assert "in progress" in text


def test_frame_sizes_and_ascii(store):
    for w, h in ((80, 24), (120, 40), (60, 16), (200, 60)):
        assert_fits(frame(store, width=w, height=h), w, h)
    f = frame(store, ascii=True)
    assert all(ord(c) < 128 for c in f.plain()), f.plain()
    assert "[3g:job101:alice" in f.plain()


def test_node_and_partition_filters(store):
    f = frame(store, nodes="gpu01")
    text = f.plain()
    starts = {line.split()[0] for line in text.splitlines() if line.startswith("gpu")}
    assert starts == {"gpu01"} and "node=gpu01" in text
    snap = V.load_snapshot(store, now=NOW)
    f = T.build_frame(snap, T.TopOptions(partition="big"), partition_nodes={"gpu03"})
    text = f.plain()
    assert {line.split()[0] for line in text.splitlines() if line.startswith("gpu")} == {"gpu03"}
    assert "Pending 1" in text and "203" in text and "201 " not in text


def big_cluster(path, nodes: int = 300, gpus: int = 8, pending: int = 120):
    rng = random.Random(7)
    layouts = [[("3g", 0), ("2g", 4), ("1g", 6)], [("7g", 0)], [("4g", 0), ("3g", 4)],
               [("1g", s) for s in range(7)], [("2g", 0), ("2g", 2), ("3g", 4)]]
    with open_store(path) as s:
        with s.transaction():
            n_job = 0
            for n in range(nodes):
                name = f"gpu{n:03d}"
                insts = []
                for g in range(gpus):
                    for kind, start in rng.choice(layouts):
                        insts.append({"gpu": g, "profile": kind, "start": start, "in_use": rng.random() < 0.6})
                s.replace_observed(name, [{"gpu": g, "model": "H100-80GB", "mig_enabled": True}
                                          for g in range(gpus)], insts, now=NOW - 1)
                for i in insts[:2]:
                    n_job += 1
                    jid = str(10_000 + n_job)
                    s.upsert_job(jid, profile=i["profile"], user="u%d" % (n_job % 17), submit_time=NOW - 500,
                                 now=NOW - 500)
                    model = s._gpu_model(name, i["gpu"])
                    s.bind(jid, name, [(i["gpu"], Slot(i["start"], model.profile(i["profile"]).name))],
                           now=NOW - 400)
                    s.set_job_state(jid, "RUNNING", node=name, now=NOW - 400)
            for k in range(pending):
                s.upsert_job(str(50_000 + k), profile=rng.choice(["1g", "2g", "3g", "4g", "7g"]), user="q",
                             submit_time=NOW - 1000 + k, now=NOW - 1000 + k)
            s.set_meta("reservations", {}, now=NOW - 1)


def test_hundreds_of_nodes_summary_and_paging(tmp_path):
    big_cluster(tmp_path / "big.db")
    store = V.open_readonly(tmp_path / "big.db")
    try:
        t0 = time.perf_counter()
        snap = V.load_snapshot(store, now=NOW)
        f = T.build_frame(snap, T.TopOptions())
        took = time.perf_counter() - t0
        assert took < 5.0, f"a 2400-GPU frame took {took:.1f}s"
        assert_fits(f, 80, 24)
        text = f.plain()
        assert f.mode == "summary" and f.pages > 10
        assert "Instances by profile" in text and "PROFILE  TOTAL  BUSY  IDLE" in text
        for kind in ("1g", "2g", "3g", "4g", "7g"):
            assert any(line.startswith(kind + " ") for line in text.splitlines())
        assert "Pending 120" in text and "more pending" in text and f"page 1/{f.pages}" in text
        # Page 2 shows other nodes; paging past the end wraps to the last page.
        f2 = T.build_frame(snap, T.TopOptions(page=2))
        nodes1 = {line.split()[0] for line in text.splitlines() if line.startswith("gpu")}
        nodes2 = {line.split()[0] for line in f2.plain().splitlines() if line.startswith("gpu")}
        assert nodes1 and nodes2 and not nodes1 & nodes2
        assert T.build_frame(snap, T.TopOptions(page=10_000)).page == f.pages
        # Forced GPU bars page through the GPUs instead.
        g = T.build_frame(snap, T.TopOptions(view="gpus", page=3))
        assert_fits(g, 80, 24)
        assert g.mode == "gpus" and g.page == 3 and g.pages >= 2400 // 20
        # Filtering to a few nodes brings the bars back.
        few = T.build_frame(snap, T.TopOptions(nodes="gpu00[0-1]"))
        assert few.mode == "gpus" and few.pages == 2 and "gpu000" in few.plain() and "gpu001 " not in few.plain()
        assert "gpu001" in T.build_frame(snap, T.TopOptions(nodes="gpu00[0-1]", page=2)).plain()
    finally:
        store.close()


def test_paginate_gpus_keeps_nodes_together_when_possible():
    nodes = [{"name": f"n{i}", "gpus": list(range(k))} for i, k in enumerate([3, 3, 3, 7])]
    pages = T._paginate_gpus(nodes, 5)
    assert [[(n["name"], len(n["gpus"])) for n in p] for p in pages] == \
        [[("n0", 3)], [("n1", 3)], [("n2", 3), ("n3", 2)], [("n3", 5)]]  # a node bigger than a page splits


# -- renderers -----------------------------------------------------------------------------------

def _gpu(instances, creating=(), slices=8):
    return {"slices": slices, "mig_enabled": True, "instances": list(instances), "creating": list(creating),
            "model": "H100-80GB", "name": "x", "layout": ""}


def _inst(kind, start, size, state="idle", job=None, user=None, action=None):
    return {"kind": kind, "start": start, "size": size, "state": state, "job_id": job, "user": user,
            "pending_action": action}


def test_gpu_bar_geometry_and_labels():
    g = R.Glyphs()
    bar = R.gpu_bar(_gpu([_inst("3g", 0, 4, "busy", "12", "alice"), _inst("2g", 4, 2), _inst("1g", 6, 1)]), 64, g)
    assert bar.plain == "[3g·job12·alice" + " " * 16 + "][2g idle" + " " * 7 + "][1g    ]········"
    assert len(bar.plain) == 64
    narrow = R.gpu_bar(_gpu([_inst("1g", s, 1, "busy", "123456", "someone") for s in range(7)]), 24, g)
    assert narrow.plain.startswith("[1]") and len(narrow.plain) == 24
    creating = R.gpu_bar(_gpu([], [{"kind": "7g", "start": 0, "size": 8}]), 64, g)
    assert creating.plain.startswith("[+7g creating")
    assert R.gpu_bar({**_gpu([]), "mig_enabled": False}, 40, g).plain.startswith("MIG off")


def test_instance_label_shortens_in_order():
    g = R.Glyphs()
    inst = _inst("3g", 0, 4, "busy", "12", "alice")
    assert R.instance_label(inst, 30, g) == "3g·job12·alice"
    assert R.instance_label(inst, 12, g) == "3g·12·alice"
    assert R.instance_label(inst, 6, g) == "3g·12"
    assert R.instance_label(inst, 3, g) == "3g"
    assert R.instance_label(_inst("2g", 0, 2, "reconfiguring", action="destroy"), 14, g) == "2g destroy"


def test_mini_bar():
    g = R.Glyphs()
    t = R.mini_bar(_gpu([_inst("3g", 0, 4, "busy"), _inst("2g", 4, 2, "idle")], [{"kind": "1g", "start": 6,
                                                                               "size": 1}]), g)
    assert t.plain == "3###2-1·"


def test_table_crops_the_flexible_column():
    lines = R.table([["1", "a" * 100]], ["ID", "WHY"], 30)
    assert all(len(x) <= 30 for x in lines) and lines[1].endswith("…")


def test_render_timeline_draws_the_simulators_segments():
    from slurm_mig.ops.explain import Segment

    segs = [Segment("n1/0", "instance", Slot(0, "3g.40gb"), 0, 10),
            Segment("n1/0", "destroy", Slot(0, "3g.40gb"), 10, 12),
            Segment("n1/0", "create", Slot(0, "7g.80gb"), 12, 14),
            Segment("n1/0", "job", Slot(0, "7g.80gb"), 14, 30, "42"),
            Segment("n1/0", "job", Slot(0, "3g.40gb"), 0, 10, "41")]
    out = R.render_timeline(segs, 0, 30, 70, job_id="42", submit=2, start=14)
    body = {line.split("|")[0].strip(): line.split("|")[1] for line in out if "|" in line}
    assert set(body) == {"queue", "n1/0 3g.40gb@0", "n1/0 7g.80gb@0"}
    assert body["queue"].lstrip().startswith("w") and ">" in body["queue"]
    assert "=" in body["n1/0 3g.40gb@0"] and "x" in body["n1/0 3g.40gb@0"]
    row = body["n1/0 7g.80gb@0"]
    assert "+" in row and "#" in row and row.index("+") < row.index("#")
    assert all(len(line) <= 70 for line in out[1:-1])


def test_render_timeline_accepts_simulator_segment_objects():
    engine = pytest.importorskip("slurm_mig.sim.engine")
    seg = engine.Segment("n00/0", "job", Slot(0, "7g.80gb"), 0.0, 5.0, "7")
    out = R.render_timeline([seg], 0, 5, 60, job_id="7")
    assert any("#" in line for line in out)


def test_run_once_prints_one_frame(store, capsys):
    assert T.run(store, T.TopOptions(width=80, height=24), once=True) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 24 and all(len(line) <= 80 for line in out)
    assert out[0].startswith("slurm-mig top")


def test_a_job_slurm_will_not_start_is_no_demand_in_the_pending_rule(tmp_path):
    # The header's queue count leaves it out (status_view); the Pending rule counted it and showed a job held
    # for a week as its profile's oldest wait.
    with open_store(tmp_path / "state.db") as s:
        build_state(s)
        s.upsert_job("900", profile="2g", submit_time=NOW - 7 * 86400, now=NOW,
                     blocked="held by its user (Slurm: JobHeldUser)")
    ro = V.open_readonly(tmp_path / "state.db")
    try:
        text = frame(ro, width=120, height=40, view="summary").plain()
    finally:
        ro.close()
    assert "queue 3" in text and "── Pending 3" in text and "2gx1" not in text, text
    assert "held by its user" in text  # still listed, with why


def test_wide_characters_in_the_pending_table_do_not_push_the_frame_past_the_terminal(tmp_path):
    """The pending table (and the text tables of `jobs`, `status`) measured and cut its cells in characters, and a
    CJK or emoji character takes two terminal cells: a user or reason in such characters made a pending line
    wider than the terminal (139 cells at 80), which the live dashboard wraps, so the frame took more rows than
    the screen and its last lines (the footer) were lost. Cells are now measured and cut in terminal cells."""
    from rich.cells import cell_len
    from rich.console import Console, Group

    with open_store(tmp_path / "state.db") as s:
        build_state(s)
        s.upsert_job("900", profile="2g", user="用户" * 20, submit_time=NOW - 5, now=NOW)
        s.set_job_state("900", "PENDING", reason="理由" * 60, now=NOW)
    ro = V.open_readonly(tmp_path / "state.db")
    try:
        f = frame(ro, width=80, height=24)
    finally:
        ro.close()
    assert_fits(f, 80, 24)
    con = Console(width=80, height=24, force_terminal=False, record=True, file=open("/dev/null", "w"))
    con.print(Group(*f.lines))  # as the live dashboard draws a frame: lines wider than the screen wrap
    assert len(con.export_text().splitlines()) == 24
    lines = R.table([["1", "用户" * 3, "x"], ["22", "ab", "用户" * 30]], ["ID", "USER", "WHY"], 30)
    assert all(cell_len(x) <= 30 for x in lines) and lines[2].endswith("…")
    assert lines == ["ID  USER          WHY", "1   用户用户用户  x", "22  ab            用户用户用…"]  # aligned in cells


def test_the_live_dashboard_in_a_terminal_narrower_than_its_frame_crops_lines_instead_of_wrapping(
        store, monkeypatch):
    """A frame is at least 40 columns wide; in a narrower terminal the live dashboard let rich wrap each line, so
    a 24-row frame took 43 rows at 30 columns and the screen showed its first half: no queue, no footer (q quit).
    Lines are now cropped at the terminal's edge, as `--once` does."""
    import io
    import re
    import sys

    from rich.console import Console

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(V.time, "time", lambda: NOW)
    monkeypatch.setattr(T._Keys, "wait", lambda self, timeout: "q")  # one frame, then q
    monkeypatch.setattr(sys, "stdout", Tty())
    for width in (30, 80):
        out = io.StringIO()
        con = Console(file=out, width=width, height=24, force_terminal=True, color_system=None)
        assert T.run(store, T.TopOptions(width=width, height=24), console=con) == 0
        screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.getvalue())
        assert "q quit" in screen and "Pending 3" in screen, (width, screen)


def test_the_live_dashboard_on_an_immutable_snapshot_opens_the_database_again_for_each_frame(tmp_path, monkeypatch):
    """A reader in db_group who cannot make the -shm while no controller is up reads the database as an immutable
    snapshot (views.open_readonly), which never sees a later write: the live dashboard, started so, drew the state of
    its first frame for as long as it ran, the controller started meanwhile (or said "malformed" at every frame once
    the controller had changed the file under it). It now opens the database again for each frame while it has such
    a snapshot. The snapshot is opened here as open_readonly opens it for that reader (root may write the folder)."""
    import io
    import re
    import sqlite3
    import sys

    import sqlite_utils
    from rich.console import Console

    from slurm_mig.store import Store
    from slurm_mig.store.db import sqlite_uri

    path = tmp_path / "state.db"
    with open_store(path) as s:
        build_state(s)
    conn = sqlite3.connect(sqlite_uri(path, "ro") + "&immutable=1", uri=True, isolation_level=None,
                           check_same_thread=False)
    snapshot = Store(sqlite_utils.Database(conn, execute_plugins=False), path=str(path))
    snapshot.immutable = True
    opened = []

    def reopen():
        opened.append(V.open_readonly(path))
        return opened[-1]

    class Tty(io.StringIO):
        def isatty(self):
            return True

    keys = iter([None, "q"])  # the controller writes, a frame is drawn; then q

    def wait(self, timeout):
        key = next(keys)
        if key is None:
            with open_store(path) as s:  # the controller, started: a fourth job waits
                s.upsert_job("204", profile="1g", user="gina", partition="gpu", submit_time=NOW - 5, now=NOW - 5)
        return key

    monkeypatch.setattr(V.time, "time", lambda: NOW)
    monkeypatch.setattr(T._Keys, "wait", wait)
    monkeypatch.setattr(sys, "stdout", Tty())
    out = io.StringIO()
    con = Console(file=out, width=80, height=24, force_terminal=True, color_system=None)
    try:
        assert T.run(snapshot, T.TopOptions(width=80, height=24), console=con, reopen=reopen) == 0
    finally:
        snapshot.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", out.getvalue())
    assert "Pending 3" in screen and "Pending 4" in screen, screen
    assert len(opened) == 1 and opened[0].immutable is False  # (root: an ordinary read) and closed by run
    with pytest.raises(sqlite3.ProgrammingError):
        opened[0].db.conn.execute("SELECT 1")


def test_the_live_dashboard_on_a_dumb_terminal_prints_a_frame_instead_of_nothing(store, monkeypatch, capsys):
    """On a terminal without cursor movement (TERM=dumb: an Emacs shell buffer, a serial console; rich says the
    same of TERM=unknown) rich's Live draws nothing while it runs and, transient, nothing when it ends: `slurm-mig
    top` showed an empty screen until q. It now prints one frame, as --once does, and says why on stderr."""
    import io
    import sys

    from rich.console import Console

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(V.time, "time", lambda: NOW)
    monkeypatch.setattr(T._Keys, "wait", lambda self, timeout: "q")  # one frame, then q
    monkeypatch.setattr(sys, "stdout", Tty())
    for term in ("dumb", "unknown"):
        out = io.StringIO()
        con = Console(file=out, width=80, height=24, force_terminal=True, _environ={"TERM": term})
        assert T.run(store, T.TopOptions(width=80, height=24), console=con) == 0
        assert "slurm-mig top" in out.getvalue() and "q quit" in out.getvalue(), (term, out.getvalue())
        assert "\x1b[?1049h" not in out.getvalue()  # no alternate screen either
        assert "cannot redraw a screen" in capsys.readouterr().err

