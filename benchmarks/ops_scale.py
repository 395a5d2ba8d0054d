#!/usr/bin/env python3
"""How long the operator's commands take against a large site's state database, beside a 2 s budget.

    .venv/bin/python benchmarks/ops_scale.py                                # 128x10000x1500 (~2 min on 2 cores)
    .venv/bin/python benchmarks/ops_scale.py --sizes 32x2500x375,64x5000x750,128x10000x1500
    .venv/bin/python benchmarks/ops_scale.py --profile 'explain {pending} --replay' --sizes 128x10000x1500
    .venv/bin/python benchmarks/ops_scale.py --churn 370                    # a long decision history too

Each size is NODESxPENDINGxRUNNING, the site of benchmarks/tick_scale.py (NODES nodes of 8 simulated
H100-80GB, PENDING queue entries, a third of them tasks of 50-task arrays, and RUNNING jobs bound to
instances): its fake Slurm and the real controller (frag-aware) fill a state database in a temporary
folder (removed afterwards) with --ticks ticks, so decisions, desired layouts and planned
reconfigurations exist. Each command then runs as an operator runs it, `slurm-mig CMD --db DB`, in a
fresh interpreter (start-up and imports included, output to a pipe), --runs times; the median wall time is
printed beside the budget, 2 s: an interactive command that takes longer feels stuck. `explain` is asked
about the head of the queue (a pending job every decision placed), the last pending entry and a running job.

With --churn N the database also holds a long decision history: after those ticks, N decisions more, one
per tick interval up to the real time, each recorded by the store's own Store.record_decision from the
controller's last real decision and the state it saw (its re-carves, placements and waiting reasons, a
1,024-GPU state of some 1.8 MB), as if the queue moved on: each decision places the next few jobs of the
queue (in the shape of the real placements) and lists a window of the queue as waiting that slides from its
head to its tail. So one job appears in the first decision alone ({early}), one in the last alone ({late}),
one in every decision ({always}: it waited through the whole history) and one in none ({never}: a pending
job left out of every decision, as a held one is); `explain` and `decisions --job` are asked about each.
At 1,024 GPUs and 10,000 pending, 370 such decisions are some 1 GB, the default [controller].keep_decisions_mb.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tick_scale as ts  # noqa: E402  (benchmarks/ is no package)

BUDGET_S = 2.0
POLICY = "frag-aware"
# The commands, as typed after `slurm-mig`; {pending}, {last} and {running} are job ids of the site.
COMMANDS = (
    "status",
    "jobs",
    "nodes",
    "decisions",
    "explain {pending}",
    "explain {last}",
    "explain {running}",
    "explain {pending} --replay",
    "explain {running} --replay",
    "top --once --view gpus",
    "top --once --view summary",
)
# With --churn: the commands about a long decision history ({early} ... {never}: see the module doc).
CHURN_COMMANDS = (
    "decisions",
    "explain {early}",
    "explain {late}",
    "explain {always}",
    "explain {never}",
    "decisions --job {early}",
    "decisions --job {late}",
    "decisions --job {always}",
    "decisions --job {never}",
)
ROOT = Path(__file__).resolve().parents[1]


def build_db(nodes: int, pending: int, running: int, ticks: int, folder: Path,
             churn: int = 0) -> tuple[Path, dict]:
    """A state database of the site after ``ticks`` controller ticks (and ``churn`` decisions more: see the
    module doc), and the job ids the commands ask about."""
    interval = ts.Config().controller.tick_interval_s
    # The site's clock ends where the real one is when the commands run, so the controller looks alive
    # (no note that it stopped) and waits and run times are as long as tick_scale made them.
    ctl, _site, _slurm, clock = ts.build(nodes, pending, running, POLICY, folder,
                                         now=time.time() - (ticks + churn) * interval)
    seen: dict = {}
    real_record = ctl.store.record_decision

    def record(decision, **kw):  # the last decision the controller recorded, and the state it saw
        seen.update(decision=decision, state=kw.get("state"))
        return real_record(decision, **kw)

    ctl.store.record_decision = record
    try:
        for _ in range(ticks):
            clock.t += interval
            ctl.tick()
        ctl.store.record_decision = real_record
        churn_ids = {}
        if churn:
            churn_ids = fill_history(ctl.store, seen["decision"], seen["state"], churn, clock.t, interval)
        db = ctl.store.db
        ids = {
            "pending": db.execute("SELECT job_id FROM jobs WHERE state = 'PENDING' ORDER BY priority_order, "
                                  "submit_time, job_id LIMIT 1").fetchone(),
            "last": db.execute("SELECT job_id FROM jobs WHERE state = 'PENDING' ORDER BY priority_order DESC, "
                               "submit_time DESC, job_id DESC LIMIT 1").fetchone(),
            "running": db.execute("SELECT job_id FROM jobs WHERE state = 'RUNNING' ORDER BY job_id "
                                  "LIMIT 1").fetchone(),
        }
        path = Path(db.execute("PRAGMA database_list").fetchone()[2])
    finally:
        ctl.store.close()
    return path, {**{k: (v[0] if v else "0") for k, v in ids.items()}, **churn_ids}


def fill_history(store, decision, state, n: int, t: float, interval: float) -> dict:
    """Record ``n`` decisions after time ``t``, one each ``interval``, made from the controller's ``decision``
    and ``state`` as the module doc says; the ids of the {early}, {late}, {always} and {never} jobs."""
    from dataclasses import replace

    from slurm_mig.store import state_to_json

    waiting = list(decision.waiting)
    never = waiting.pop()[0]  # the queue's last entry: in no decision
    step = max(1, len(waiting) // (2 * n))  # jobs placed per decision
    window = len(waiting) - n * step  # jobs listed as waiting in each
    if window <= step or not decision.assignments:
        raise SystemExit(f"--churn {n}: the queue ({len(waiting)} waiting) or the decision (no placement) is too "
                         f"small for {n} decisions")
    inputs = state_to_json(state)
    shapes = decision.assignments
    for k in range(n):
        placed = tuple(replace(shapes[i % len(shapes)], job_id=job_id)
                       for i, (job_id, _why) in enumerate(waiting[k * step:(k + 1) * step]))
        d = replace(decision, assignments=(*placed, *decision.assignments),
                    waiting=tuple(waiting[(k + 1) * step:(k + 1) * step + window]))
        store.record_decision(d, inputs=inputs, latency_ms=100.0, now=t + (k + 1) * interval)
    return {"early": waiting[0][0], "late": waiting[-1][0], "always": waiting[n * step][0], "never": never}


def command_argv(command: str, ids: dict, db: Path, config: Path) -> list[str]:
    return [*command.format(**ids).split(), "--config", str(config), "--db", str(db)]


def run_once(argv: list[str]) -> tuple[float, int, int]:
    """One `slurm-mig ARGV` in a fresh interpreter: (wall seconds, exit status, bytes printed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               COLUMNS="120", LINES="40")
    env.pop("SLURM_MIG_CONFIG", None)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())",
                        *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    return time.perf_counter() - t0, p.returncode, len(p.stdout)


def measure(nodes: int, pending: int, running: int, *, ticks: int, runs: int, commands=COMMANDS,
            folder: Path, profile: str | None = None, churn: int = 0) -> dict:
    t0 = time.perf_counter()
    db, ids = build_db(nodes, pending, running, ticks, folder, churn)
    build_s = time.perf_counter() - t0
    config = folder / "slurm-mig.toml"
    config.write_text(f'[policy]\nname = "{POLICY}"\n')
    rows = []
    for command in commands:
        argv = command_argv(command, ids, db, config)
        walls, rcs, out = [], set(), 0
        for _ in range(runs):
            wall, rc, out = run_once(argv)
            walls.append(wall)
            rcs.add(rc)
        rows.append({"command": command.format(**ids), "template": command, "median_s": statistics.median(walls),
                     "max_s": max(walls), "rc": sorted(rcs), "stdout_bytes": out, "over_budget": statistics.median(walls) > BUDGET_S})
    prof = None
    if profile:
        prof = profile_command(command_argv(profile, ids, db, config), folder / "ops.prof")
    return {"nodes": nodes, "gpus": nodes * ts.GPUS_PER_NODE, "pending": pending, "running": running,
            "build_s": build_s, "db_bytes": db.stat().st_size, "churn": churn,
            "decisions": _count_decisions(db), "ids": ids, "budget_s": BUDGET_S,
            "commands": rows, "profile": prof}


def _count_decisions(db: Path) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        return conn.execute("SELECT COUNT(*) FROM decisions").fetchone()[0]


def profile_command(argv: list[str], out: Path) -> str:
    """cProfile of one command in this process (its output discarded); the top functions, as text."""
    import contextlib
    import io

    from slurm_mig.cli import main

    prof = cProfile.Profile()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        prof.enable()
        try:
            main(argv)
        except SystemExit:
            pass
        finally:
            prof.disable()
    prof.dump_stats(out)
    text = io.StringIO()
    pstats.Stats(str(out), stream=text).sort_stats("cumulative").print_stats(35)
    return text.getvalue()


def summary_lines(results: list[dict]) -> list[str]:
    """The table: one line per command, a column per size (median seconds), the budget, and OVER where the
    largest size's median is past it."""
    heads = [f"{r['nodes']}x{r['pending']}x{r['running']}" for r in results]
    commands = [c.get("template", c["command"]) for c in results[0]["commands"]]
    width = max(len(c) for c in commands)
    out = [f"{'slurm-mig ... --db DB':<{width}} " + " ".join(f"{h:>15}" for h in heads) + "  budget"]
    for k, command in enumerate(commands):
        cells = " ".join(f"{r['commands'][k]['median_s']:>14.2f}s" for r in results)
        last = results[-1]["commands"][k]
        flag = "  OVER" if last["over_budget"] else ""
        bad = "" if last["rc"] == [0] else f"  (exit {','.join(str(x) for x in last['rc'])})"
        out.append(f"{command:<{width}} {cells}  {BUDGET_S:.1f}s{flag}{bad}")
    for h, r in zip(heads, results):
        i = r["ids"]
        out.append(f"  {h}: {{pending}} the queue's head, job {i['pending']}; {{last}} its last entry, job "
                   f"{i['last']}; {{running}} job {i['running']}")
        if r.get("churn"):
            out.append(f"  {h}: {r['decisions']} decisions ({r['db_bytes'] / 1e6:.0f} MB database); {{early}} job "
                       f"{i['early']}, {{late}} job {i['late']}, {{always}} job {i['always']}, {{never}} job "
                       f"{i['never']}")
    over = [c["command"] for c in results[-1]["commands"] if c["over_budget"]]
    out.append(f"{len(over)} of {len(results[-1]['commands'])} over the {BUDGET_S:.0f} s budget at "
               f"{heads[-1]}" + (": " + "; ".join(over) if over else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [ts._size(x) for x in s.split(",")], default=[(128, 10000, 1500)],
                    help="NODESxPENDINGxRUNNING,... (default 128x10000x1500)")
    ap.add_argument("--ticks", type=int, default=4, help="controller ticks before the commands run (default 4)")
    ap.add_argument("--runs", type=int, default=3, help="runs of each command; the median is shown (default 3)")
    ap.add_argument("--profile", metavar="COMMAND",
                    help="also cProfile this command (e.g. 'explain {pending} --replay') at the last size")
    ap.add_argument("--churn", type=int, default=0, metavar="N",
                    help="also record N decisions more, a long history, and time the commands about it alone")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ops-scale-") as d:
        for k, (n, q, r) in enumerate(args.sizes):
            sub = Path(d) / f"{n}x{q}x{r}"
            sub.mkdir()
            prof = args.profile if k == len(args.sizes) - 1 else None
            results.append(measure(n, q, r, ticks=args.ticks, runs=args.runs, folder=sub, profile=prof,
                                   churn=args.churn, commands=CHURN_COMMANDS if args.churn else COMMANDS))
            if not args.json:
                print(f"built {n}x{q}x{r}: {results[-1]['build_s']:.0f} s, database "
                      f"{results[-1]['db_bytes'] / 1e6:.0f} MB", flush=True)
    if args.json:
        print(json.dumps({"ops_scale": results}))
        return 0
    for line in summary_lines(results):
        print(line)
    if results[-1]["profile"]:
        print(results[-1]["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
