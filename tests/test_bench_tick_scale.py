"""benchmarks/tick_scale.py's fake Slurm prints what Slurm 22.05 prints for such a site: the records hold
the fields of the captures in tests/test_slurm_parsers.py and tests/test_controller_gres_events.py, and
sinfo and scontrol agree about each node."""

from __future__ import annotations

import json

from slurm_mig.slurm import parsers
from slurm_mig.slurm.gres import GRES_TYPES, PAD_TYPE
from tests.helpers import load_benchmark
from tests.test_controller_gres_events import SINFO_SET
from tests.test_slurm_parsers import SCONTROL_NODE_N1_D, SQUEUE_JSON_22_05

ts = load_benchmark("tick_scale")


def _site():
    """4 nodes, 30 pending, 40 running jobs; the last node's jobs ended (Slurm's node answers only)."""
    site = ts.Site(4, 30, 40, 1795257118.0)
    for (name, _gi), insts in site.gpus.items():
        if name == site.names[-1]:
            for inst in insts:
                inst[2] = None
    return site


def test_running_jobs_carry_the_fields_22_05_prints_for_them():
    captured = json.loads(SQUEUE_JSON_22_05)["jobs"]
    want = {k for j in captured if j["job_state"] == "RUNNING" for k in j}
    got = [j for j in json.loads(_site().squeue())["jobs"] if j["job_state"] == "RUNNING"]
    assert got and all(set(j) == want for j in got)
    assert all(j["job_resources"]["nodes"] == j["nodes"] and j["billable_tres"] == 1.0 for j in got)


def test_sinfo_lists_every_configured_type_used_and_agrees_with_scontrol():
    site = _site()
    real = json.loads(SINFO_SET)["nodes"][0]
    nodes = json.loads(site.sinfo())["nodes"]
    for n in nodes:
        assert set(n) == set(real)
        # 22.05 lists in gres_used every type slurm.conf configures, pad included
        assert [x.split(":")[1] for x in n["gres_used"].split(",")] == [*GRES_TYPES, PAD_TYPE]
        assert [x.split(":")[1] for x in n["gres"].split(",")] == [*GRES_TYPES, PAD_TYPE]
    assert nodes[-1]["state"] == "idle" and nodes[-1]["alloc_cpus"] == 0
    assert nodes[0]["state"] == "mixed" and nodes[0]["alloc_cpus"] > 0
    by_name = {n.name: n for n in parsers.parse_sinfo_json(json.loads(site.sinfo()))}
    for name in site.names:
        text = site.scontrol_node(name)
        (sc,) = parsers.parse_scontrol_nodes(text)
        s = by_name[name]
        assert (sc.state, sc.alloc_cpus, sc.gres) == (s.state, s.alloc_cpus, s.gres)
        # AllocTRES as 22.05 prints it: empty with nothing allocated, cpu=N otherwise
        alloc_tres = next(w for w in text.split() if w.startswith("AllocTRES="))
        assert alloc_tres == (f"AllocTRES=cpu={s.alloc_cpus}" if s.alloc_cpus else "AllocTRES=")
    # the same lines as a real node's, less -d's GresDrain/GresUsed
    real_keys = [line.split("=")[0].split()[0] for line in SCONTROL_NODE_N1_D.splitlines() if line.strip()]
    keys = [line.split("=")[0].split()[0] for line in site.scontrol_node(site.names[0]).splitlines() if line.strip()]
    assert keys == [k for k in real_keys if k not in ("GresDrain", "GresUsed")]


def test_a_steady_queue_records_the_decision_once_not_each_tick(tmp_path):
    """In a steady queue (nothing starts or ends) the decision repeats, and the controller records a decision
    only when it differs from the last one recorded. frag-aware's reason for a job holding a reservation on a
    GPU it could start on now named the time ('reserved gpu002/4 from t=1795257133s', the tick's own time),
    so every tick's decision differed and was recorded (15 of 16 ticks at 128 GPUs and 500 pending jobs, 150 KB
    each). It now says 'from now': only decisions that change something are recorded."""
    ctl, _site, _slurm, clock = ts.build(2, 30, 10, "frag-aware", tmp_path)
    try:
        def ticks(n):
            for _ in range(n):
                clock.t += ctl.cfg.controller.tick_interval_s
                ctl.tick()
        ticks(4)  # the re-carves of the first ticks are planned (no node carries them out here)
        before = ctl.store.db.execute("SELECT MAX(id) FROM decisions").fetchone()[0]
        ticks(4)
        assert ctl.store.db.execute("SELECT MAX(id) FROM decisions").fetchone()[0] == before
        reasons = " ".join(r for d in ctl.store.recent_decisions(1) for _j, r in d.reasons)
        assert "reserved" in reasons and "from now" in reasons  # the case this is about
    finally:
        ctl.store.close()
