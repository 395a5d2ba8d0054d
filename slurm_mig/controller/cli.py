"""`slurm-mig controller`: run the head-node controller (API server + tick loop)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run the slurm-mig controller on the Slurm head node")
    p.add_argument("--once", action="store_true", help="run one tick, print its summary as JSON, and exit")
    p.add_argument("--no-api", action="store_true", help="do not serve the node API (with --once)")
    p.set_defaults(func=_run)


def build(cfg):
    """The controller's parts from a Config: store, Slurm client, Controller."""
    from slurm_mig.controller.service import Controller
    from slurm_mig.slurm.runner import SlurmClient
    from slurm_mig.store import open_store_from_config

    store = open_store_from_config(cfg)
    slurm = SlurmClient.from_config(cfg)
    return Controller(cfg, store, slurm)


def make_auth(cfg):
    from slurm_mig.api.auth import auth_from_settings

    return auth_from_settings(cfg.auth.method, munge_socket=cfg.auth.munge_socket, key_file=cfg.auth.hmac_key_file,
                              max_skew_s=cfg.auth.max_clock_skew_s)


def serve(cfg, controller):
    """Start the node API in a background thread; returns the ApiServer."""
    from slurm_mig.api.server import ApiServer

    return ApiServer(cfg.controller.listen_host, cfg.controller.listen_port, make_auth(cfg), controller.routes(),
                     controller.get_routes(),
                     on_error=lambda kind, msg: controller.metrics.inc("slurm_mig_api_errors_total",
                                                                       (("kind", kind),))).start()


def _run(args: argparse.Namespace) -> int:
    from slurm_mig.config import load_config

    cfg = load_config(args.config)
    logging.basicConfig(level=getattr(logging, cfg.log.level.upper(), logging.INFO),
                        filename=cfg.log.file or None,
                        format="%(asctime)s slurm-mig-controller %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    controller = build(cfg)
    if args.once:
        server = None if args.no_api else serve(cfg, controller)
        try:
            print(json.dumps(controller.tick(), default=str))
        finally:
            if server:
                server.stop()
        return 0
    from apscheduler.schedulers.background import BackgroundScheduler

    server = serve(cfg, controller)
    log = logging.getLogger("slurm_mig.controller")
    log.info("controller listening on %s:%d, policy %s, tick %.1fs", *server.address,
             controller.policy.name, cfg.controller.tick_interval_s)

    def safe_tick():
        try:
            controller.tick()
        except Exception:  # one bad tick (DB locked, Slurm down) must not end the loop
            log.exception("tick failed")
            controller.metrics.inc("slurm_mig_tick_failures_total")

    sched = BackgroundScheduler()
    sched.add_job(safe_tick, "interval", seconds=cfg.controller.tick_interval_s, max_instances=1, coalesce=True,
                  id="tick")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    safe_tick()
    sched.start()
    stop.wait()
    log.info("controller stopping")
    sched.shutdown(wait=True)
    server.stop()
    controller.store.close()
    return 0
