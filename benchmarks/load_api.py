"""Load on the node API: N simulated nodes' hooks calling one controller at once (loopback only).

    .venv/bin/python benchmarks/load_api.py --nodes 1000                 # HMAC
    .venv/bin/python benchmarks/load_api.py --nodes 1000 --auth munge    # MUNGE (starts a private munged)
    .venv/bin/python benchmarks/load_api.py --nodes 1000 --json out.json

The controller runs in a subprocess, exactly as in production but for Slurm: a real Controller with
a real state database (a file, WAL), the real ApiServer and authenticator, and its tick running
every second against a stand-in Slurm that lists the N jobs. Each simulated node is a thread that
waits at a barrier, then does what a node's hooks do for one job, back to back, as fast as it can:

    /v1/report   health check: 2 H100 GPUs (3g+2g+1g each) and its binding files
    /v1/prolog   the job starts: the controller chooses and binds an instance
    /v1/bound    the Prolog confirms the binding with the instance's UUID
    /v1/epilog   the job ends: the controller records the outcome (exactly once)

Every request is signed the way the hooks sign it (munge runs the ``munge`` command per request, as
a hook does); the latency reported is the HTTP round trip (sending the signed request, the
controller's work, the answer), with signing timed separately. An error is any request that does
not come back 200 (no retries: the hooks would retry, hiding errors). Afterwards the database must
hold exactly N outcomes and no live binding. Everything is bounded by --deadline (default 60 s).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROUTES = ("/v1/report", "/v1/prolog", "/v1/bound", "/v1/epilog")
# The bound every latency here is judged against: a hook gives up on a request after [node].request_timeout_s.
REQUEST_TIMEOUT_S = 5.0
LAYOUT = [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]


def node_name(i: int) -> str:
    return f"gpu{i:04d}"


def observed(i: int, in_use: set[tuple[int, int]] = frozenset()) -> list[dict]:
    return [{"index": g, "uuid": f"GPU-{i}-{g}", "name": "NVIDIA H100 80GB HBM3", "model": "H100-80GB",
             "mig_enabled": True, "lost": False,
             "instances": [{"profile": p, "start": s, "uuid": f"MIG-{i}-{g}-{s}", "in_use": (g, s) in in_use}
                           for p, s in LAYOUT]} for g in (0, 1)]


# -- the controller side (subprocess) --------------------------------------------------------------

def serve(args) -> int:
    import logging

    from slurm_mig.api.auth import auth_from_settings
    from slurm_mig.api.server import ApiServer
    from slurm_mig.config import Config
    from slurm_mig.controller.service import Controller
    from slurm_mig.slurm.parsers import SlurmJob, SlurmNode
    from slurm_mig.store import open_store

    logging.basicConfig(level=logging.WARNING, filename=args.log, format="%(asctime)s %(levelname)s %(message)s")
    store = open_store(args.db)
    now = time.time()
    jobs = []
    with store.transaction():
        for i in range(args.nodes):
            store.upsert_job(str(1000 + i), profile="1g", count=1, user="alice", name=f"load{i}", now=now)
            jobs.append(SlurmJob(job_id=1000 + i, name=f"load{i}", user="alice", state="RUNNING",
                                 nodes=[node_name(i)], mig={"1g": 1}, tres_per_node="gres:mig:1g:1",
                                 submit_time=int(now), priority=1))

    class Slurm:
        """slurmctld as the controller sees it during the run: the N jobs, running on their nodes until
        their Epilog is recorded (then gone, as Slurm forgets ended jobs: still listed, an ended job would
        read as Slurm running it again)."""

        def jobs(self):
            done = {o.job_id for o in store.outcomes()}
            return [j for j in jobs if str(j.job_id) not in done]

        def nodes(self):
            return []

        def job_detail(self, job_id):
            return None

        def scontrol_requeue(self, job_id, **kw):
            raise AssertionError("no job should need a requeue")

        def update_node_gres(self, node, counts, **kw):
            return ""

    ctl = Controller(Config(), store, Slurm())
    # The node-origin check ([auth].node_origin, "warn" by default) on every request: every node's NodeAddr
    # is this host, as on the local cluster. (The stand-in Slurm lists no nodes, so the tick does not.)
    ctl.origins.update([SlurmNode(name=node_name(i), state="idle", address="127.0.0.1") for i in range(args.nodes)])
    auth = auth_from_settings(args.auth, munge_socket=args.munge_socket, key_file=args.key, max_skew_s=300)
    errors: list[str] = []
    srv = ApiServer("127.0.0.1", 0, auth, ctl.routes(), ctl.get_routes(),
                    on_error=lambda kind, msg: errors.append(f"{kind}: {msg}")).start()
    stop = threading.Event()
    ticks: list[float] = []

    def tick_loop():
        while not stop.wait(1.0):
            t0 = time.perf_counter()
            try:
                ctl.tick()
            except Exception as exc:  # counted: a failed tick is a controller error
                errors.append(f"tick: {type(exc).__name__}: {exc}")
            ticks.append(time.perf_counter() - t0)

    threading.Thread(target=tick_loop, daemon=True).start()
    Path(args.port_file).write_text(str(srv.address[1]))
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    srv.stop()
    live = store._q("SELECT COUNT(*) AS n FROM bindings WHERE released_at IS NULL")[0]["n"]
    summary = {"outcomes": len(store.outcomes()), "live_bindings": live, "controller_errors": errors[:20],
               "controller_error_count": len(errors), "ticks": len(ticks),
               "origin_checks": {r: ctl.metrics.counters.get(("slurm_mig_node_origin_checks_total", (("result", r),)), 0.0)
                                 for r in ("match", "mismatch", "unchecked")},
               "tick_max_s": round(max(ticks), 3) if ticks else None}
    Path(args.port_file).with_suffix(".done").write_text(json.dumps(summary))
    store.close()
    return 0


# -- the nodes (this process) -------------------------------------------------------------------------

class NodeSim(threading.Thread):
    def __init__(self, i: int, port: int, auth, barrier: threading.Barrier, deadline: float):
        super().__init__(daemon=True)
        self.i, self.port, self.auth, self.barrier, self.deadline = i, port, auth, barrier, deadline
        self.node = node_name(i)
        self.latency: dict[str, float] = {}
        self.sign_s: list[float] = []
        self.errors: list[str] = []

    def call(self, route: str, payload: dict) -> dict | None:
        body = json.dumps(payload, sort_keys=True).encode()
        t0 = time.perf_counter()
        header = self.auth.sign(body, self.node, path=route)
        self.sign_s.append(time.perf_counter() - t0)
        timeout = max(1.0, self.deadline - time.monotonic())
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        t0 = time.perf_counter()
        try:
            conn.request("POST", route, body=body, headers={"Content-Type": "application/json",
                                                            "X-Slurm-Mig-Auth": header})
            resp = conn.getresponse()
            data = resp.read()
        except OSError as exc:
            self.errors.append(f"{route}: {type(exc).__name__}: {exc}")
            return None
        finally:
            conn.close()
        self.latency[route] = time.perf_counter() - t0
        if resp.status != 200:
            self.errors.append(f"{route}: HTTP {resp.status}: {data[:200]!r}")
            return None
        return json.loads(data)

    def run(self):
        job = str(1000 + self.i)
        try:
            self.barrier.wait(timeout=120)
        except threading.BrokenBarrierError:
            self.errors.append("barrier broken")
            return
        if self.call("/v1/report", {"node": self.node, "observed": observed(self.i), "bindings": {},
                                    "time": time.time()}) is None:
            return
        resp = self.call("/v1/prolog", {"job_id": job, "node": self.node, "observed": observed(self.i),
                                        "bindings": {}})
        if resp is None:
            return
        if resp.get("action") != "bind":
            self.errors.append(f"/v1/prolog: answered {resp}")
            return
        insts = [{"gpu": x["gpu"], "profile": x["profile"], "start": x["start"],
                  "uuid": f"MIG-{self.i}-{x['gpu']}-{x['start']}"} for x in resp["instances"]]
        if self.call("/v1/bound", {"job_id": job, "node": self.node, "instances": insts, "bound_at": time.time(),
                                   "local": False}) is None:
            return
        self.call("/v1/epilog", {"job_id": job, "node": self.node, "instances": insts, "exit_code": 0,
                                 "derived_ec": 0, "end_time": time.time(), "lingering": []})


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, int(round(p / 100 * len(values) + 0.5)) - 1))
    return values[k]


def _start_munged(tmp: Path) -> tuple[str, int]:
    key = tmp / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    sock = str(tmp / "munge.socket")
    res = subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}", f"--pid-file={tmp}/munged.pid",
                          f"--log-file={tmp}/munged.log", f"--seed-file={tmp}/munged.seed", "--num-threads=4"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"cannot start munged: {res.stderr.strip()}")
    return sock, int((tmp / "munged.pid").read_text())


def run(args) -> dict:
    from slurm_mig.api.auth import auth_from_settings, create_key

    tmp = Path(tempfile.mkdtemp(prefix="sm-load-"))
    munged_pid = None
    try:
        key = tmp / "hmac.key"
        create_key(str(key))
        sock = None
        if args.auth == "munge":
            if not shutil.which("munged"):
                raise SystemExit("munge is not installed (apt-get install munge)")
            sock, munged_pid = _start_munged(tmp)
        port_file = tmp / "port"
        server = subprocess.Popen([sys.executable, __file__, "--serve", "--nodes", str(args.nodes), "--db",
                                   str(tmp / "state.db"), "--auth", args.auth, "--key", str(key),
                                   "--munge-socket", sock or "", "--port-file", str(port_file),
                                   "--log", str(tmp / "controller.log")])
        t0 = time.monotonic()
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() - t0 > 60:
                raise SystemExit("the controller did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        # Hooks run as root: MUNGE credentials from uid 0 are what the controller accepts.
        auth = auth_from_settings(args.auth, munge_socket=sock, key_file=str(key), max_skew_s=300)
        deadline = time.monotonic() + args.deadline
        barrier = threading.Barrier(args.nodes + 1)
        sims = [NodeSim(i, port, auth, barrier, deadline) for i in range(args.nodes)]
        for s in sims:
            s.start()
        barrier.wait(timeout=120)
        start = time.monotonic()
        for s in sims:
            s.join(timeout=max(0.0, deadline - time.monotonic()))
        wall = time.monotonic() - start
        unfinished = sum(s.is_alive() for s in sims)
        time.sleep(1.5)  # let a tick run after the burst
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        done = json.loads(port_file.with_suffix(".done").read_text())
        lat = {r: [s.latency[r] for s in sims if r in s.latency] for r in ROUTES}
        every = [v for vs in lat.values() for v in vs]
        errors = [e for s in sims for e in s.errors]
        sign = [v for s in sims for v in s.sign_s]
        result = {
            "nodes": args.nodes, "auth": args.auth, "requests": len(every) + len(errors), "ok": len(every),
            "errors": len(errors) + unfinished, "error_samples": errors[:10], "unfinished_nodes": unfinished,
            "wall_s": round(wall, 2), "throughput_rps": round(len(every) / wall, 1) if wall else None,
            "p50_ms": round(_pct(every, 50) * 1000, 1), "p99_ms": round(_pct(every, 99) * 1000, 1),
            "max_ms": round(max(every) * 1000, 1) if every else None,
            "per_route": {r: {"n": len(v), "p50_ms": round(_pct(v, 50) * 1000, 1),
                              "p99_ms": round(_pct(v, 99) * 1000, 1)} for r, v in lat.items()},
            "sign_p50_ms": round(_pct(sign, 50) * 1000, 2), "sign_p99_ms": round(_pct(sign, 99) * 1000, 2),
            "outcomes_recorded": done["outcomes"], "live_bindings_after": done["live_bindings"],
            "controller_errors": done["controller_error_count"], "controller_error_samples": done["controller_errors"],
            "ticks_during_run": done["ticks"], "tick_max_s": done["tick_max_s"],
            "origin_checks": done.get("origin_checks"),
            "mean_ms": round(statistics.fmean(every) * 1000, 1) if every else None,
            "request_timeout_s": REQUEST_TIMEOUT_S,
            "over_timeout": sum(1 for v in every if v >= REQUEST_TIMEOUT_S),
        }
        # An answer slower than the hooks' timeout is one a hook would have given up on.
        result["passed"] = (result["errors"] == 0 and result["controller_errors"] == 0
                            and result["over_timeout"] == 0
                            and result["outcomes_recorded"] == args.nodes and result["live_bindings_after"] == 0)
        return result
    finally:
        if munged_pid:
            try:
                os.kill(munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--auth", choices=("hmac", "munge"), default="hmac")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds the whole burst may take")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--db", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--munge-socket", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        args.munge_socket = args.munge_socket or None
        return serve(args)
    threading.stack_size(256 * 1024)  # 1000 client threads
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("\n".join(summary_lines(result)))
    return 0 if result["passed"] else 1


def summary_lines(result: dict) -> list[str]:
    """What the benchmark prints: our figures beside the bound they must stay under."""
    out = [f"{result['nodes']} nodes x 4 requests ({result['auth']}): {result['ok']} ok, {result['errors']} errors "
           f"in {result['wall_s']} s ({result['throughput_rps']} req/s)",
           f"latency p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, max {result['max_ms']} ms; "
           f"signing p50 {result['sign_p50_ms']} ms, p99 {result['sign_p99_ms']} ms",
           f"bound: the hooks' request timeout, {result['request_timeout_s'] * 1000:.0f} ms ([node].request_timeout_s "
           f"default); {result['over_timeout']} answers took longer"]
    for r, v in result["per_route"].items():
        out.append(f"  {r:12s} n={v['n']:5d}  p50 {v['p50_ms']:8.1f} ms  p99 {v['p99_ms']:8.1f} ms")
    out.append(f"outcomes recorded {result['outcomes_recorded']}/{result['nodes']}, live bindings after "
               f"{result['live_bindings_after']}, controller errors {result['controller_errors']}, "
               f"ticks during the run {result['ticks_during_run']} (slowest {result['tick_max_s']} s)")
    if result.get("origin_checks"):
        out.append("node-origin checks: " + ", ".join(f"{k} {v:g}" for k, v in result["origin_checks"].items()))
    if result["error_samples"] or result["controller_error_samples"]:
        out.append("\n  ".join(["errors:", *(result["error_samples"] + result["controller_error_samples"])[:10]]))
    out.append("PASS" if result["passed"] else "FAIL")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
