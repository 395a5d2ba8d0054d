"""`slurm-mig top` against the running demo cluster, in a real 80x24 terminal (tmux).

The demo cluster is real Slurm with slurm-mig's hooks, controller and node agents on simulated
H100s (3 nodes x 2 GPUs). Eight 7g jobs need six re-carved GPUs, so two of them must wait. The
dashboard runs in a detached tmux session of exactly 80x24; the captured screen must show every
node, every GPU's instances in slice order, and every pending job with its profile, and answer the
keys (v: summary view, q: quit).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurm_mig.democluster import DemoCluster

pytestmark = pytest.mark.slurm

W, H = 80, 24


def _need_tmux() -> str:
    if shutil.which("tmux") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "tmux"]
        if subprocess.run(cmd, env=env, capture_output=True, timeout=300).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
            subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    path = shutil.which("tmux")
    if path is None:
        pytest.skip("tmux is not installed and could not be installed")
    return path


def _capture(tmux: str, session: str) -> str:
    res = subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True, timeout=10)
    return res.stdout if res.returncode == 0 else ""


def _problems(screen: str, store) -> list[str]:
    """What the screen fails to show, judged against the controller's database right now."""
    lines = screen.rstrip("\n").split("\n")
    out = []
    if len(lines) > H or any(len(x) > W for x in lines):
        out.append(f"screen is not within {W}x{H}: {len(lines)} lines, widest {max(map(len, lines))}")
    gpu_lines: dict[tuple[str, int], str] = {}
    node = None
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if line[:1].isalnum() and len(parts) >= 3 and parts[2].isdigit():
            node = parts[0]
            gpu_lines[(node, int(parts[2]))] = line
        elif line.startswith(" ") and node and parts[0].isdigit() and "[" in line:
            gpu_lines[(node, int(parts[0]))] = line
    gpus = store.observed_gpus()
    for g in gpus:
        line = gpu_lines.get((g.node, g.gpu))
        if line is None:
            out.append(f"no line for {g.node} GPU {g.gpu}")
            continue
        # every instance, in slice order, as its kind at the start of its box
        pos = 0
        for inst in store.observed_instances(g.node, g.gpu):
            kind = inst.profile.split(".")[0]
            i = line.find("[" + kind, pos)
            i2 = line.find("[+" + kind, pos)
            found = min(x for x in (i, i2) if x >= 0) if max(i, i2) >= 0 else -1
            if found < 0:
                out.append(f"{g.node}/{g.gpu}: no {kind}@{inst.start} box after column {pos} in {line!r}")
                break
            pos = found + 1
    for name in sorted({g.node for g in gpus}):
        if not any(x.startswith(name + " ") for x in lines):
            out.append(f"node {name} not shown")
    pending = store.pending_jobs(include_bound=True)
    if not pending:
        out.append("no job is pending in the database (nothing to check in the queue)")
    rows = {x.split()[0]: x for x in lines if x[:1].isdigit()}
    for j in pending:
        row = rows.get(j.job_id)
        if row is None or j.profile not in row.split():
            out.append(f"pending job {j.job_id} ({j.profile}) not in the queue rows")
    if f"Pending {len(pending)}" not in screen:
        out.append(f"queue header does not say 'Pending {len(pending)}'")
    return out


def test_top_in_tmux_at_80x24_shows_nodes_layouts_and_the_queue(slurm_installed):
    tmux = _need_tmux()
    session = f"slurm-mig-top-test-{os.getpid()}"
    # A short state folder: slurmd's per-job sockets live in it and must stay under 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="sm-top-", dir="/tmp"))
    dc = DemoCluster(state, tick_s=1.0, agent_s=1.0)
    t0 = time.monotonic()
    try:
        dc.start(timeout=60)
        ids = [dc.sbatch("mig:7g", 25, name="big") for _ in range(8)] + [dc.sbatch("mig:1g", 25, name="small")]
        store = dc.store()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # six 7g running (re-carved), two still waiting
            if len(store.running_jobs()) >= 6 and len(store.pending_jobs(include_bound=True)) >= 2:
                break
            time.sleep(0.5)
        slurm_mig = Path(sys.executable).with_name("slurm-mig")
        cmd = f"{slurm_mig} --config {dc.config_path} top --interval 1"
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
        subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", str(W), "-y", str(H), cmd], check=True,
                       env={**os.environ, "TERM": "xterm-256color", "LANG": "C.UTF-8"}, timeout=10)
        screen, problems = "", ["not captured"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1.0)
            screen = _capture(tmux, session)
            problems = _problems(screen, store)
            if not problems:
                break
        print(f"\n--- tmux {W}x{H} screen ---\n{screen}--- end ---")
        assert not problems, "\n".join(problems) + "\n" + screen
        assert screen.startswith("slurm-mig top") and "controller ok" in screen
        assert "[7g·job" in screen and "·root" in screen  # instance boxes carry job and user
        # v switches to the per-profile summary, q quits.
        subprocess.run([tmux, "send-keys", "-t", session, "v"], check=True)
        time.sleep(1.5)
        summary = _capture(tmux, session)
        assert "Instances by profile" in summary and "7g" in summary, summary
        subprocess.run([tmux, "send-keys", "-t", session, "q"], check=True)
        time.sleep(1.0)
        alive = subprocess.run([tmux, "has-session", "-t", session], capture_output=True).returncode == 0
        assert not alive, "top did not quit on q"
        store.close()
        for j in ids:
            subprocess.run(["scancel", j], env=dc.env(), capture_output=True, timeout=20)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], capture_output=True)
        dc.stop()
        shutil.rmtree(state, ignore_errors=True)
    assert time.monotonic() - t0 < 90
