"""`slurm-mig controller`: run the head-node controller (API server + tick loop)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
import time

# A tick still running when the next is due is said at most this often (a slow slurmctld can keep
# every tick late for hours; one line per tick would bury the rest of the log).
OVERRUN_LOG_EVERY_S = 600.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("controller", help="run the slurm-mig controller on the Slurm head node")
    p.add_argument("--once", action="store_true", help="run one tick, print its summary as JSON, and exit")
    p.add_argument("--no-api", action="store_true", help="do not serve the node API (with --once)")
    p.set_defaults(func=_run)


def claim_database(db_path: str, group: str | int | None = None):
    """Hold an exclusive lock beside the state database for as long as this process runs: two controllers
    on one database would both tick, set GRES and requeue jobs from in-memory state that disagrees.
    Returns the open lock file (keep it), or None for an in-memory database. AlreadyRunning (exit 75) when
    another process holds it; the kernel releases it when that process dies, however it dies. ``group``:
    [controller].db_group, for the database's folders, made here as the store makes them (it runs first)."""
    import os
    from pathlib import Path

    from slurm_mig import pidlock
    from slurm_mig.errors import AlreadyRunning, StoreError
    from slurm_mig.store.connection import make_db_folders, resolve_gid

    if not db_path or db_path == ":memory:":
        return None
    path = db_path + ".controller.lock"
    # Not os.makedirs: it made the folder 0700 whatever db_group says (the store leaves one that exists as it
    # is, so the group's readers could not enter it) and those above it 0777 less the umask.
    make_db_folders(Path(os.path.abspath(path)).parent, resolve_gid(group))
    try:
        fd, holder = pidlock.hold(path)
    except OSError as exc:  # the path runs through a file (NotADirectoryError), a read-only folder, ...
        raise StoreError(f"state database {db_path}: cannot make its lock file {path}: {exc.strerror}") from None
    if fd is None:
        raise AlreadyRunning(f"another slurm-mig controller (pid {holder}) is running on {db_path}; stop it "
                             f"first (systemctl stop slurm-mig-controller), or use another [controller] db_path")
    return os.fdopen(fd, "r+")


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
                              max_skew_s=cfg.auth.max_clock_skew_s, node_keys_dir=cfg.auth.hmac_node_keys_dir or None,
                              replay_window_s=cfg.auth.replay_window_s, controller_uid=cfg.auth.controller_uid)


def check_answer_signer(cfg, euid: int | None = None) -> None:
    """With MUNGE, refuse (ConfigError, exit 2) to serve the node API as a user whose answers the nodes refuse:
    they accept answers signed by root or by ``[auth].controller_user`` only, so a controller run as another
    user (the SlurmUser, with controller_user left at "root") had every answer refused ("answer signed by uid
    N, not by the controller"), and every hook took its fallback while the controller looked healthy."""
    import os
    import pwd

    from slurm_mig.errors import ConfigError

    euid = os.geteuid() if euid is None else euid
    if cfg.auth.method != "munge" or euid in (0, cfg.auth.controller_uid):
        return
    try:
        name = pwd.getpwuid(euid).pw_name
        me, value = f"{name} (uid {euid})", f'"{name}"'
    except KeyError:
        me, value = f"uid {euid}", str(euid)
    user = cfg.auth.controller_user
    said = f'"{user}"' if isinstance(user, str) else str(user)
    where = f"config {cfg.source}" if cfg.source else "config <built-in defaults>"
    raise ConfigError(f'{where}: [auth].controller_user: the controller runs as {me}, but with method = "munge" the '
                      f"nodes accept answers signed by root or by controller_user ({said}, uid "
                      f"{cfg.auth.controller_uid}) only, and would refuse every answer it signs: set "
                      f"controller_user = {value} in [auth] of this config and of the nodes' (docs/admin-guide.md, "
                      f"step 6), or run the controller as root; nothing was done")


def serve(cfg, controller):
    """Start the node API in a background thread; returns the ApiServer."""
    from slurm_mig.api.server import ApiServer
    from slurm_mig.errors import ConfigError

    host, port = cfg.controller.listen_host, cfg.controller.listen_port
    auth = make_auth(cfg)
    try:
        server = ApiServer(host, port, auth, controller.routes(), controller.get_routes(),
                           on_error=lambda kind, msg: controller.metrics.inc("slurm_mig_api_errors_total",
                                                                             (("kind", kind),)))
    except OSError as exc:  # a name that does not resolve (gaierror), an address not ours, a port in use
        where = f"config {cfg.source}" if cfg.source else "config <built-in defaults>"
        raise ConfigError(f"{where}: [controller].listen_host, listen_port: cannot listen on {host}:{port}: "
                          f"{exc.strerror or exc}") from None
    return server.start()


class _NoOverrunLines(logging.Filter):
    """Drops apscheduler's own line for a skipped run; schedule_ticks says it in our words instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances reached" not in record.getMessage()


def schedule_ticks(sched, tick, interval_s: float, metrics, log: logging.Logger,
                   every_s: float = OVERRUN_LOG_EVERY_S):
    """Add ``tick`` to the (not yet started) apscheduler ``sched`` every ``interval_s``, one at a time.

    A tick that outlasts the interval makes the next one wait (``max_instances=1``, ``coalesce``):
    each skipped run is counted in ``slurm_mig_ticks_skipped_total`` and said in one warning at most
    every ``every_s`` seconds, with the count since the last warning (a LogLimiter). When ticks have
    caught up (none skipped for ``every_s``, LogLimiter.ended, asked after each tick) a closing line
    says how many were skipped in all since the first, if any went unsaid since the last warning."""
    from apscheduler.events import EVENT_JOB_MAX_INSTANCES

    from slurm_mig.api.loglimit import LogLimiter

    aps = logging.getLogger("apscheduler.scheduler")
    if not any(isinstance(f, _NoOverrunLines) for f in aps.filters):
        aps.addFilter(_NoOverrunLines())
    quiet = LogLimiter(every_s)
    # this run of skipped ticks: how many in all, and when the first was (wall clock, for the closing line)
    flood = {"total": 0, "since": 0.0}
    lock = threading.Lock()

    def skipped(_event) -> None:
        metrics.inc("slurm_mig_ticks_skipped_total")
        held = quiet.say("skipped", time.monotonic())
        with lock:
            if held == 0:  # a first (again, after none skipped for every_s): a new run of skipped ticks
                flood["total"], flood["since"] = 0, time.time()
            flood["total"] += 1
        if held is not None:
            log.warning("a tick was still running when the next was due (tick_interval_s %g s): %d tick(s) "
                        "skipped since the last such warning; ticks run back to back until they catch up. A slow "
                        "slurmctld or an overloaded head node does this; slurm_mig_tick_seconds shows how long "
                        "ticks take (this warning at most every %g s)", interval_s, held + 1, every_s)

    def say_caught_up() -> None:
        for _line, held in quiet.ended(time.monotonic()):
            with lock:
                total, since = flood["total"], flood["since"]
            log.warning("ticks caught up: %d skipped in total since %s, %d of them since the last warning; none "
                        "skipped in the last %g s", total,
                        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)), held, every_s)

    def run() -> None:
        try:
            tick()
        finally:
            say_caught_up()

    sched.add_listener(skipped, EVENT_JOB_MAX_INSTANCES)
    sched.add_job(run, "interval", seconds=interval_s, max_instances=1, coalesce=True, id="tick")
    return sched


def _run(args: argparse.Namespace) -> int:
    from slurm_mig.config import check_trusted, check_written_folders, find_config, load_config

    from slurm_mig.errors import ConfigError

    # Before anything is read from it: whoever can change the config chooses the file root appends its log to,
    # the database, the model the rl policy runs and the keys the node API trusts. As root or as its own user.
    check_trusted(find_config(args.config), "the controller", only_as_root=False)
    cfg = load_config(args.config)
    # ... and the folders it names must stay its own: the log's and the database's (refused as the config is)
    check_written_folders(cfg, "the controller", controller=True, only_as_root=False)
    if not (args.once and args.no_api):  # it signs answers: as a user the nodes accept them from
        check_answer_signer(cfg)
    try:  # opened here, not by basicConfig(filename=): a folder or a missing one was logging's traceback
        from slurm_mig.folders import log_file_handler

        # made 0644 whatever the umask: logging.FileHandler made it 0666 under umask 0, root's log anyone could write
        handler = log_file_handler(cfg.log.file) if cfg.log.file else logging.StreamHandler()
    except OSError as exc:
        raise ConfigError(f"config {cfg.source or '<built-in defaults>'}: [log].file: cannot open {cfg.log.file} "
                          f"to append to: {exc.strerror}") from None
    logging.basicConfig(level=getattr(logging, cfg.log.level.upper(), logging.INFO), handlers=[handler],
                        format="%(asctime)s slurm-mig-controller %(levelname)s %(name)s: %(message)s")
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    lock = claim_database(cfg.controller.db_path, cfg.controller.db_group)  # noqa: F841  (held until it ends)
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

    sched = schedule_ticks(BackgroundScheduler(), safe_tick, cfg.controller.tick_interval_s, controller.metrics, log)
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
