"""`make test`: the whole suite as two pytest runs side by side, the Slurm tests beside the others.

The tests under tests/slurm spend most of their time waiting on a real Slurm cluster (jobs, requeues,
daemons restarting), the others on the CPU; one after the other they took 14 minutes on the 2-core
machine of 2026-11-27, side by side about 9. They are two processes, not pytest-xdist workers:
tests/slurm must run one at a time (one cluster per session or module), and xdist's groups did not
hold with pytest 9 (its tests ran on both workers, two clusters raced for the same ports).

With arguments it is one plain pytest run of them (`scripts/run_tests.py tests/test_store.py -x`).
Exit status: 0 when both runs passed, else the first failing run's status. A SIGINT, SIGTERM or
SIGHUP (a CI timeout) goes to both runs, whose fixtures then stop the daemons they started
(tests/conftest.py); the Slurm run's output is printed after the other's in every case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest"]
    if argv:
        return subprocess.call([*pytest, *argv], cwd=ROOT)
    with tempfile.TemporaryFile("w+b") as slurm_out:
        runs = []

        def forward(signum, frame):
            for p in runs:
                if p.poll() is None:
                    p.send_signal(signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, forward)
        # Started first: its cluster boots while the other run collects
        runs.append(subprocess.Popen([*pytest, "-q", "tests/slurm"], cwd=ROOT, stdout=slurm_out,
                                     stderr=subprocess.STDOUT))
        runs.append(subprocess.Popen([*pytest, "-q", "--ignore=tests/slurm"], cwd=ROOT))
        print(f"tests/slurm run beside the others (pid {runs[0].pid}); its output follows theirs", flush=True)
        codes = [p.wait() for p in reversed(runs)][::-1]
        slurm_out.seek(0)
        sys.stdout.write("\n== tests/slurm ==\n")
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), slurm_out.read())
    print(f"\n== tests/slurm: exit {codes[0]}; the others: exit {codes[1]} ==", flush=True)
    # a run killed by a signal has a negative returncode: the shell's 128 + N
    return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
