"""The controller's Prometheus metrics, scraped from the running demo cluster (docs/metrics.md).

Eight 7g jobs (two must wait) and one 1g job run on the demo cluster. While the 7g jobs queue,
``slurm_mig_queue_depth{profile="7g"}`` must say so; once they have finished every series that
docs/metrics.md lists must be there with live values: waits, re-carves and their duration, policy
latency, the tick, instances and node state, GRES re-assertions, finished jobs, and errors by kind
(an unauthenticated POST for the API, and the message a Prolog sends when a re-carve fails for the
hooks).
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slurm_mig.democluster import DemoCluster

pytestmark = pytest.mark.slurm

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value for every sample of /metrics (and a check of the text format)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"not Prometheus text format: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def _diagnose(dc) -> str:
    """What the operator tools and Slurm say, for a failure message."""
    import subprocess
    import sys

    exe = str(Path(sys.executable).with_name("slurm-mig"))
    out = []
    for argv in ([exe, "--config", str(dc.config_path), "top", "--once", "--width", "100", "--height", "40"],
                 [exe, "--config", str(dc.config_path), "jobs", "--state", "all"],
                 ["squeue", "-o", "%i %T %r %b %N"], ["sinfo", "-N", "-o", "%N %T %G"]):
        r = subprocess.run(argv, env=dc.env(), capture_output=True, text=True, timeout=30)
        out.append("$ " + " ".join(argv[-4:]) + "\n" + r.stdout + r.stderr)
    return "\n".join(out)


def series(samples: dict[str, float], name: str) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k == name or k.startswith(name + "{")}


def test_metrics_scrape_has_the_documented_series_with_live_values(slurm_installed):
    # A short state folder: slurmd's per-job sockets live in it and must stay under 108 bytes.
    state = Path(tempfile.mkdtemp(prefix="sm-metrics-", dir="/tmp"))
    dc = DemoCluster(state, tick_s=1.0, agent_s=1.0)
    t0 = time.monotonic()
    try:
        dc.start(timeout=60)
        ids = [dc.sbatch("mig:7g", 4, name="big") for _ in range(8)] + [dc.sbatch("mig:1g", 2, name="small")]
        # While jobs wait, the queue depth by profile is exported.
        depth_seen = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not depth_seen:
            depth_seen = {k: v for k, v in series(scrape(dc.port), "slurm_mig_queue_depth").items() if v > 0}
            time.sleep(0.3)
        assert 'slurm_mig_queue_depth{profile="7g"}' in depth_seen, depth_seen

        # An unauthenticated request counts as an API error of kind "auth".
        req = urllib.request.Request(f"http://127.0.0.1:{dc.port}/v1/report", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(req, timeout=5)

        # A Prolog whose re-carve failed reports it (signed with MUNGE, as the hook does): a hook error.
        from slurm_mig.api.client import ControllerClient
        from slurm_mig.config import load_config
        from slurm_mig.controller.cli import make_auth

        cfg = load_config(dc.config_path)
        store = dc.store()
        waiting = [j.job_id for j in store.pending_jobs()]
        store.close()
        assert waiting, "expected a waiting job"
        client = ControllerClient(cfg.node.controller_url, make_auth(cfg), "n1", timeout_s=5)
        assert client.call("/v1/bind-failed", {"job_id": waiting[-1], "node": "n1",
                                               "results": [{"gpu": 0, "ok": False,
                                                            "error": "test: injected create failure"}]})["ok"]

        if not dc.wait_jobs(ids, timeout=60):
            pytest.fail("jobs did not finish:\n" + _diagnose(dc))
        time.sleep(2.5)  # a tick and an agent report after the last epilog
        m = scrape(dc.port)
    finally:
        dc.stop()
        shutil.rmtree(state, ignore_errors=True)

    def one(name: str) -> float:
        assert name in m, f"{name} missing from /metrics; have: {sorted(m)}"
        return m[name]

    # queue and waits
    assert one('slurm_mig_wait_seconds_count') == len(ids)
    assert one('slurm_mig_wait_seconds_bucket{le="+Inf"}') == len(ids)
    assert one('slurm_mig_wait_seconds_sum') > 0  # two 7g jobs waited for a GPU
    assert one('slurm_mig_jobs_finished_total{state="COMPLETED"}') == len(ids)
    # re-carving: how many, how they ended, how long they took
    assert one('slurm_mig_reconfigurations_total{result="ok"}') >= 1
    assert one('slurm_mig_reconfiguration_seconds_count') >= 1
    assert 0 < one('slurm_mig_reconfiguration_seconds_sum') < 60 * one('slurm_mig_reconfiguration_seconds_count')
    # the policy and the loop
    assert one('slurm_mig_policy_latency_seconds_count') >= 1
    assert one('slurm_mig_policy_latency_seconds_bucket{le="+Inf"}') == one('slurm_mig_policy_latency_seconds_count')
    assert one('slurm_mig_tick_seconds_count') >= 5
    # errors by kind
    assert one('slurm_mig_hook_errors_total{kind="bind_failed"}') >= 1
    assert one('slurm_mig_api_errors_total{kind="auth"}') >= 1
    # every node's hooks spoke for their own node, through the cluster's munged: no origin mismatch
    assert not series(m, "slurm_mig_node_origin_mismatches_total")
    assert one('slurm_mig_node_origin_checks_total{result="match"}') >= len(ids)
    assert one('slurm_mig_node_origin_checks_total{result="mismatch"}') == 0
    # the cluster
    for node in dc.nodes:
        assert one(f'slurm_mig_node_up{{node="{node}"}}') == 1
        assert series(m, "slurm_mig_instances") and any(f'node="{node}"' in k for k in series(m, "slurm_mig_instances"))
        assert one(f'slurm_mig_gres_reasserted_total{{node="{node}"}}') >= 1
    total = sum(series(m, "slurm_mig_instances").values())
    assert total >= len(dc.nodes) * dc.gpus_per_node  # at least one instance per GPU
    # histograms are cumulative
    for h in ("slurm_mig_wait_seconds", "slurm_mig_policy_latency_seconds", "slurm_mig_tick_seconds",
              "slurm_mig_reconfiguration_seconds"):
        buckets = [(float(re.search(r'le="([^"]+)"', k).group(1).replace("+Inf", "inf")), v)
                   for k, v in m.items() if k.startswith(h + "_bucket")]
        counts = [v for _, v in sorted(buckets)]
        assert counts == sorted(counts), f"{h} buckets are not cumulative: {sorted(buckets)}"
    assert time.monotonic() - t0 < 90
