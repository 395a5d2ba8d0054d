"""A large job behind a stream of small ones on one GPU, on the real local Slurm cluster: how long the
large job waits, and how many small jobs are requeued on the way.

    .venv/bin/python benchmarks/reserved_region.py              # about 3 minutes
    .venv/bin/python benchmarks/reserved_region.py --json out.json

One node with one simulated H100 carved 7 x 1g. Seven 1g jobs run (the i-th for ``--step`` x i seconds);
a ``mig:7g`` job is queued, then seven more 1g jobs. The scenario runs once per setting of
``[controller] hold_reserved``:

* ``true`` (ours, the default): the region the policy reserves for the 7g drains for it (its instances
  are kept from Slurm's counts and from other jobs' Prologs);
* ``false`` (the baseline: slurm-mig before 2026-11-27, and any scheduler that tells Slurm of every idle
  instance): Slurm gives each freed 1g to the next 1g job, and the 7g waits until they run out.

Printed for each: the 7g's wait, its bound (the 7g cannot start before the last of the first seven 1g
jobs ends: that moment, from its submission), the requeues, and the later 1g jobs' mean wait. The
waits are from slurm-mig's store (a job's start is its Prolog's binding, its submission the sbatch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_mig.democluster import DemoCluster  # noqa: E402

SEVEN_1G = ",".join(f"1g@{i}" for i in range(7))


def make_cluster(state_dir, *, hold_reserved: bool, tick_s: float = 1.0) -> DemoCluster:
    """One node, one simulated H100 carved 7 x 1g, the controller's hold-back on or off."""
    return DemoCluster(state_dir, nodes=1, gpus_per_node=1, initial_layout=SEVEN_1G, tick_s=tick_s,
                       controller_options={"hold_reserved": hold_reserved})


def run_scenario(dc: DemoCluster, *, step: float = 4.0, later: int = 7, later_s: float = 20.0,
                 timeout: float = 400.0) -> dict:
    """Seven 1g jobs of ``step`` x (1..7) s, then a 7g of 3 s, then ``later`` 1g jobs of ``later_s`` s, on a
    started cluster; returns the figures (seconds from each job's submission)."""
    time.sleep(3)  # the first tick and the node's first report
    first = [dc.sbatch("mig:1g", step * (i + 1), name=f"first{i}") for i in range(7)]
    time.sleep(2)  # all seven running
    submitted = {}
    submitted["big"] = time.time()
    big = dc.sbatch("mig:7g", 3, name="big")
    time.sleep(0.5)
    rest = []
    for i in range(later):
        submitted[f"later{i}"] = time.time()
        rest.append(dc.sbatch("mig:1g", later_s, name=f"later{i}"))
    finished = dc.wait_jobs(first + [big] + rest, timeout=timeout)
    store = dc.store()
    try:
        rows = {r["job_id"]: r for r in store.db.query("SELECT job_id, start_time, end_time FROM jobs")}
        requeues = [e.message for e in store.recent_events(10_000, kind="requeue")]
    finally:
        store.close()

    def started(job):
        r = rows.get(job)
        return r["start_time"] if r and r["start_time"] is not None else None

    big_start = started(big)
    first_ends = [rows[j]["end_time"] for j in first if j in rows and rows[j]["end_time"] is not None]
    later_waits = [started(j) - submitted[f"later{i}"] for i, j in enumerate(rest) if started(j) is not None]
    queued = later_waits + ([big_start - submitted["big"]] if big_start is not None else [])
    return {
        "finished": finished,
        "big_wait_s": None if big_start is None else round(big_start - submitted["big"], 1),
        "bound_s": round(max(first_ends) - submitted["big"], 1) if len(first_ends) == 7 else None,
        "requeues": len(requeues),
        "later_mean_wait_s": round(statistics.mean(later_waits), 1) if later_waits else None,
        "queued_mean_wait_s": round(statistics.mean(queued), 1) if queued else None,
        "later_before_big": sum(1 for j in rest if big_start is not None and started(j) is not None
                                and started(j) < big_start),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step", type=float, default=4.0, help="the i-th first 1g job runs step x i seconds")
    p.add_argument("--later", type=int, default=7, help="1g jobs queued behind the 7g")
    p.add_argument("--later-s", type=float, default=20.0, help="how long each of those runs, in seconds")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    results = {}
    for name, hold in (("hold_reserved = true (ours)", True), ("hold_reserved = false (baseline)", False)):
        with tempfile.TemporaryDirectory(prefix="sm-region-", dir="/tmp") as tmp:
            with make_cluster(tmp, hold_reserved=hold) as dc:
                results[name] = run_scenario(dc, step=args.step, later=args.later, later_s=args.later_s)
    print(f"A 7g queued behind seven busy 1g jobs ({args.step:g}-{7 * args.step:g} s) and before {args.later} "
          f"more 1g jobs ({args.later_s:g} s), one H100 (the real local Slurm cluster):")
    print(f"  {'':34} {'7g wait':>8} {'bound':>7} {'requeues':>9} {'later 1g wait':>14} {'1g before 7g':>13} "
          f"{'all queued':>11}")
    for name, r in results.items():
        print(f"  {name:34} {r['big_wait_s']!s:>7}s {r['bound_s']!s:>6}s {r['requeues']:>9} "
              f"{r['later_mean_wait_s']!s:>13}s {r['later_before_big']:>13} {r['queued_mean_wait_s']!s:>10}s"
              + ("" if r["finished"] else "  (not all jobs finished)"))
    print("  7g wait and later 1g wait: from submission to the Prolog's binding; all queued: the mean over the 7g and")
    print("  the later 1g jobs. bound: the 7g cannot start before the last of the first seven 1g jobs ends (from its")
    print("  submission). The hold-back keeps Slurm's priority order (the 7g first), at the later 1g jobs' cost.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["finished"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
