"""Prolog wall time on the local demo cluster, one job at a time (no contention), and in a burst.

    .venv/bin/python benchmarks/prolog_latency.py [--jobs 15]

Prints the median and p90 of the Prolog's own wall time (interpreter start-up included; measured by the
hook from the time its shell wrapper started) for jobs whose instance already exists, and for jobs
whose instance had to be created (a reconfiguration).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from slurm_mig.democluster import DemoCluster
from slurm_mig.demo import prolog_latencies


def p90(values) -> float:
    """The 90th percentile, interpolated between ranks (the lower rank understated it: with 5 values it
    was the second largest)."""
    v = sorted(values)
    return v[0] if len(v) == 1 else statistics.quantiles(v, n=10, method="inclusive")[-1]


def _stats(values):
    if not values:
        return "n=0"
    v = sorted(values)
    return f"n={len(v)} median={statistics.median(v):.0f} ms p90={p90(v):.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=15)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sm-lat-", dir="/tmp") as tmp:
        dc = DemoCluster(tmp, nodes=3, gpus_per_node=2, delay_scale=1.0)
        try:
            dc.start()
            log = dc.state / "log" / "slurm-mig.log"
            # One at a time: 1g jobs use instances that exist; 7g jobs need a reconfiguration.
            for i in range(args.jobs):
                job = dc.sbatch("mig:1g" if i % 3 else "mig:7g", 0.2, name=f"lat{i}")
                dc.wait_jobs([job], timeout=120)
                time.sleep(1.5)  # let the node agent restore the layout between jobs
            sequential = prolog_latencies(log)
            # A burst: everything at once on 2 cores with 3 slurmd, the controller and 3 agents.
            ids = [dc.sbatch(g, 2, name="burst") for g in ["mig:1g", "mig:2g", "mig:3g"] * 6]
            dc.wait_jobs(ids, timeout=300)
            time.sleep(2)
            burst = prolog_latencies(log)[len(sequential):]
        finally:
            dc.stop()
    print("Prolog wall time (slurm-mig hook, Python start-up included):")
    print(f"  one job at a time, instance exists:      {_stats([ms for ms, r in sequential if not r])}")
    print(f"  one job at a time, with reconfiguration: {_stats([ms for ms, r in sequential if r])}")
    print(f"  burst of {len(ids)} jobs, instance exists:       {_stats([ms for ms, r in burst if not r])}")
    print(f"  burst of {len(ids)} jobs, with reconfiguration:  {_stats([ms for ms, r in burst if r])}")
    print("  bound: the hook's budget is Slurm's PrologEpilogTimeout (default: none); H100 create/destroy "
          "steps take 0.16-0.42 s each (FACTS §2), charged 1:1 here (delay_scale=1.0)")


if __name__ == "__main__":
    main()
