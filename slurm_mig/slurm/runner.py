"""The one way slurm-mig runs Slurm commands.

Every Slurm command goes through :func:`run_slurm`: an argv list (never a shell
string), a timeout, ``SLURM_CONF`` taken from the caller, the client or the
environment, and a :class:`SlurmResult` with return code, output and duration.
On top of it:

* :func:`query_slurm` for reads that may fail (returns ``None``; the caller
  keeps its last known state and treats it as stale),
* :func:`check_slurm` for commands that must succeed (raises
  :class:`~slurm_mig.errors.SlurmCommandError`),
* :class:`SlurmClient` with typed wrappers (squeue/sinfo JSON, scontrol show,
  sbatch, scancel, requeue, reconfigure, node Gres updates). Module-level
  functions of the same names use a default client that reads ``SLURM_CONF``
  from the environment.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from slurm_mig.errors import SlurmCommandError
from slurm_mig.slurm import gres as gres_mod
from slurm_mig.slurm import parsers

log = logging.getLogger(__name__)

#: Seconds a Slurm command may take before it is killed. slurmctld answers in
#: milliseconds when healthy; anything near this means it is down or wedged.
DEFAULT_TIMEOUT = 30.0

#: Slurm commands one process runs at once, a backstop: a burst of callers would otherwise fork as many
#: commands, each an RPC to slurmctld. The rest wait for a slot, within their own timeout. The controller
#: caps its request-time scontrol calls lower (Controller.DETAIL_CONCURRENCY), so its tick always finds one.
MAX_CONCURRENT = 32
_SLOTS = threading.BoundedSemaphore(MAX_CONCURRENT)


@dataclass(frozen=True)
class SlurmResult:
    """What one Slurm command did."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its timeout."""
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """A one-line summary for error messages and logs."""
        why = "timed out" if self.timed_out else f"exit {self.returncode}"
        err = (self.stderr or self.stdout).strip().splitlines()
        tail = " | ".join(err[-3:]) if err else "no output"
        return f"`{' '.join(self.argv)}` failed ({why}, {self.duration:.2f}s): {tail}"

    def check(self) -> SlurmResult:
        """Return self, or raise SlurmCommandError when the command failed."""
        if not self.ok:
            raise SlurmCommandError(
                self.describe(), argv=self.argv, returncode=self.returncode,
                stdout=self.stdout, stderr=self.stderr,
            )
        return self


def slurm_env(env: Mapping[str, str] | None = None, slurm_conf: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a Slurm client command.

    Starts from ``os.environ``, overlays ``env``, then sets ``SLURM_CONF`` to
    ``slurm_conf`` when given. Without one the inherited SLURM_CONF (or Slurm's
    compiled-in /etc/slurm/slurm.conf) is used.
    """
    out = dict(os.environ)
    if env:
        out.update(env)
    if slurm_conf is not None:
        out["SLURM_CONF"] = os.fspath(slurm_conf)
    # The query commands' input variables change what they list or how: SQUEUE_FORMAT/SINFO_FORMAT the text we
    # parse, SQUEUE_USERS/SQUEUE_PARTITION/SQUEUE_STATES/SQUEUE_ARRAY/SINFO_PARTITION which jobs or nodes, and
    # SLURM_CLUSTERS which cluster. Inherited by the controller or a hook, one would hide jobs from the tick or a
    # job's own record from job_detail; none is ours to honour.
    for var in [v for v in out if v.startswith(("SQUEUE_", "SINFO_", "SCONTROL_"))]:
        out.pop(var)
    for var in ("SLURM_TIME_FORMAT", "SLURM_CLUSTERS"):
        out.pop(var, None)
    return out


def run_slurm(argv: Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT,
              env: Mapping[str, str] | None = None, input: str | None = None,
              slurm_conf: str | os.PathLike | None = None) -> SlurmResult:
    """Run one Slurm command and return what it did; never raises for its failure.

    ``argv`` is a list such as ``["scontrol", "show", "node", "n1"]``; it is
    executed directly (no shell). A missing binary gives returncode 127, one that
    cannot be started (not executable, no process to be had) 126, and a
    timeout gives ``timed_out=True`` with returncode 124, so callers handle
    every failure the same way. Use :func:`check_slurm` when failure is an error.
    """
    if isinstance(argv, (str, bytes)):
        raise TypeError("run_slurm takes an argv list, not a shell string")
    argv_t = tuple(os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv)
    started = time.monotonic()
    # No timeout: wait for a slot as long as it takes (acquire(timeout=-1) gives up at once when none is free).
    if not (_SLOTS.acquire() if timeout is None else _SLOTS.acquire(timeout=timeout)):
        return SlurmResult(argv_t, 124, "", f"not run: {MAX_CONCURRENT} Slurm commands were already running "
                           f"for {timeout}s", time.monotonic() - started, timed_out=True)
    try:
        left = None if timeout is None else max(0.1, timeout - (time.monotonic() - started))
        # Slurm prints job names, comments, paths and reasons as the bytes it was given, which need not be
        # UTF-8 (a latin-1 working directory, `sbatch -J $'\xe9'`): read strictly, one such job would make
        # every squeue raise instead of answer. Undecodable bytes read as U+FFFD.
        proc = subprocess.run(
            argv_t, input=input, capture_output=True, encoding="utf-8", errors="replace", timeout=left,
            env=slurm_env(env, slurm_conf), stdin=None if input is not None else subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return SlurmResult(argv_t, 127, "", f"{argv_t[0]}: command not found (is Slurm installed?)",
                           time.monotonic() - started)
    except OSError as exc:  # not executable for us, or no process to be had (fork's EAGAIN under load)
        return SlurmResult(argv_t, 126, "", f"{argv_t[0]}: could not be run: {exc}", time.monotonic() - started)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return SlurmResult(argv_t, 124, out, err + f"\ntimed out after {timeout}s",
                           time.monotonic() - started, timed_out=True)
    finally:
        _SLOTS.release()
    result = SlurmResult(argv_t, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)
    log.debug("slurm %s -> %s in %.3fs", " ".join(argv_t), result.returncode, result.duration)
    return result


def query_slurm(argv: Sequence[str], **kwargs) -> SlurmResult | None:
    """Run a read-only command; return the result, or None (logged) when it failed."""
    result = run_slurm(argv, **kwargs)
    if not result.ok:
        log.warning("%s", result.describe())
        return None
    return result


def check_slurm(argv: Sequence[str], **kwargs) -> SlurmResult:
    """Run a command that must succeed; raise SlurmCommandError when it did not."""
    return run_slurm(argv, **kwargs).check()


@dataclass
class SlurmClient:
    """Typed Slurm commands bound to one cluster (one slurm.conf).

    ``slurm_conf=None`` means "whatever SLURM_CONF the process has". ``env``
    adds variables to every command; ``timeout`` is the per-command default.
    Query methods return ``None`` when Slurm could not be asked (controller
    down, timeout); action methods raise SlurmCommandError.
    """

    slurm_conf: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg) -> SlurmClient:
        """A client from a slurm_mig.config.Config ([controller] slurm_conf, [slurm] command_timeout_s)."""
        return cls(slurm_conf=cfg.controller.slurm_conf or None, timeout=cfg.slurm.command_timeout_s)

    # -- plumbing -------------------------------------------------------
    def run(self, argv: Sequence[str], *, timeout: float | None = None, input: str | None = None,
            env: Mapping[str, str] | None = None) -> SlurmResult:
        """run_slurm with this client's SLURM_CONF, env and timeout."""
        merged = dict(self.env)
        if env:
            merged.update(env)
        return run_slurm(argv, timeout=self.timeout if timeout is None else timeout,
                         env=merged, input=input, slurm_conf=self.slurm_conf)

    def query(self, argv: Sequence[str], **kwargs) -> SlurmResult | None:
        """Like :func:`query_slurm` with this client's settings."""
        result = self.run(argv, **kwargs)
        if not result.ok:
            log.warning("%s", result.describe())
            return None
        return result

    def check(self, argv: Sequence[str], **kwargs) -> SlurmResult:
        """Like :func:`check_slurm` with this client's settings."""
        return self.run(argv, **kwargs).check()

    def _json(self, argv: Sequence[str], member: str) -> dict | None:
        """The decoded document, or None (stale data) unless it is an object whose ``member`` is a list."""
        res = self.query(argv)
        if res is None:
            return None
        try:
            doc = json.loads(res.stdout)
        except json.JSONDecodeError as exc:
            log.warning("`%s` printed invalid JSON: %s", " ".join(argv), exc)
            return None
        # Slurm 22.05 fact: with slurmctld unreachable, squeue/sinfo --json exit 0
        # and print an empty list plus "errors". Treating that as "no jobs"
        # would be a disaster, so any error makes the answer unusable.
        if not isinstance(doc, dict):
            log.warning("`%s` printed JSON that is not an object: ignored", " ".join(argv))
            return None
        errors = parsers.json_errors(doc)
        if errors:
            log.warning("`%s` reported errors: %s", " ".join(argv), "; ".join(errors))
            return None
        # No list at all is not an empty one: read as "no jobs", it would cancel every pending job.
        if not isinstance(doc.get(member), list):
            log.warning("`%s` printed no %r list: ignored", " ".join(argv), member)
            return None
        return doc

    # -- queries ----------------------------------------------------------
    def squeue_json(self, *, all_states: bool = False) -> dict | None:
        """Raw ``squeue --json`` document, or None when squeue failed.

        By default Slurm lists pending/running/completing jobs and those that
        ended less than MinJobAge ago; ``all_states`` adds ``--states=all``.
        """
        argv = ["squeue", "--json"]
        if all_states:
            argv.insert(1, "--states=all")
        return self._json(argv, "jobs")

    def jobs(self, *, all_states: bool = False) -> list[parsers.SlurmJob] | None:
        """Parsed jobs from ``squeue --json``, or None when squeue failed."""
        doc = self.squeue_json(all_states=all_states)
        return None if doc is None else parsers.parse_squeue_json(doc)

    def sinfo_json(self) -> dict | None:
        """Raw ``sinfo --json`` document, or None when sinfo failed."""
        return self._json(["sinfo", "--json"], "nodes")

    def nodes(self) -> list[parsers.SlurmNode] | None:
        """Parsed nodes from ``sinfo --json``, or None when sinfo failed."""
        doc = self.sinfo_json()
        return None if doc is None else parsers.parse_sinfo_json(doc)

    def job_detail(self, job_id: int | str) -> parsers.JobDetail | None:
        """One job's record from ``squeue -h --states=all -j ID -O ...`` (parsers.parse_job_detail); None if
        Slurm failed or forgot the job. What the hooks and the controller ask Slurm about one job: it reads
        no text the job's user writes, where ``scontrol show job`` prints such text, newlines included, in
        the same lines as the request (parsers.JOB_DETAIL_FIELDS)."""
        res = self.query(["squeue", "-h", "--states=all", "-j", str(job_id), "-O", parsers.JOB_DETAIL_FORMAT])
        return None if res is None else parsers.parse_job_detail(res.stdout, job_id)

    def scontrol_show_job(self, job_id: int | str) -> parsers.JobDetail | None:
        """Parsed ``scontrol show job -d ID``; None if Slurm failed or forgot the job. Not for deciding what a
        job may have (its user's text can forge lines there: use job_detail)."""
        res = self.query(["scontrol", "-d", "show", "job", str(job_id)])
        if res is None:
            return None
        jobs = parsers.parse_scontrol_jobs(res.stdout)
        return jobs[0] if jobs else None

    def reservations(self) -> list[parsers.SlurmReservation] | None:
        """Parsed ``scontrol -o show reservation``; None when scontrol failed."""
        res = self.query(["scontrol", "-o", "show", "reservation"])
        return None if res is None else parsers.parse_reservations(res.stdout)

    def scontrol_show_nodes(self, node: str | None = None) -> list[parsers.SlurmNode] | None:
        """Parsed ``scontrol show node [NODE]``; None when scontrol failed."""
        argv = ["scontrol", "show", "node"] + ([node] if node else [])
        res = self.query(argv)
        return None if res is None else parsers.parse_scontrol_nodes(res.stdout)

    def ping(self) -> bool:
        """True when slurmctld answers ``scontrol ping`` as UP."""
        res = self.run(["scontrol", "ping"], timeout=min(self.timeout, 10))
        return res.ok and "is UP" in res.stdout

    # -- actions ------------------------------------------------------------
    def update_node_gres(self, node: str, counts: Mapping[str, int], *,
                         keep_other: bool = True, pad_to: int | None = None) -> str:
        """Set node ``node``'s mig GRES to ``counts`` with ``scontrol update``; return the value set.

        Every known type is written (0 where absent) because Slurm keeps types
        that a Gres update leaves out, at their old count. Non-mig GRES on the
        node are kept when ``keep_other`` (one extra ``scontrol show node``).
        With ``pad_to`` a ``mig:pad`` item keeps the node's mig total at that
        value (see :mod:`slurm_mig.slurm.gres`). Note Slurm does not validate
        the value at all, and the change is lost on ``scontrol reconfigure`` or
        a slurmctld restart (slurm.conf wins).
        """
        other: list[str] = []
        if keep_other:
            found = self.scontrol_show_nodes(node)
            if found is None:
                raise SlurmCommandError(f"cannot read node {node} before updating its Gres")
            other = gres_mod.other_gres(found[0].gres_raw) if found else []
        value = gres_mod.format_node_gres(counts, include_all=True, other=other, pad_to=pad_to)
        self.check(["scontrol", "update", f"NodeName={node}", f"Gres={value}"])
        return value

    def update_node_state(self, node: str, state: str, reason: str | None = None) -> None:
        """``scontrol update NodeName=node State=state [Reason=...]`` (e.g. DRAIN, RESUME)."""
        argv = ["scontrol", "update", f"NodeName={node}", f"State={state}"]
        if reason:
            argv.append(f"Reason={reason}")
        self.check(argv)

    def sbatch(self, script: str | os.PathLike | None = None, *, wrap: str | None = None,
               gres: str | None = None, args: Sequence[str] = (), script_text: str | None = None,
               env: Mapping[str, str] | None = None, timeout: float | None = None) -> int:
        """Submit a batch job and return its job id.

        Give exactly one of ``script`` (a path), ``script_text`` (fed on stdin)
        or ``wrap`` (a command line for ``--wrap``). ``gres`` becomes
        ``--gres=...``; ``args`` are further sbatch options. A rejection by
        job_submit.lua raises SlurmCommandError whose ``stderr`` holds the
        message the user would see.
        """
        if sum(x is not None for x in (script, wrap, script_text)) != 1:
            raise ValueError("sbatch needs exactly one of script, script_text or wrap")
        argv = ["sbatch", "--parsable"]
        if gres is not None:
            argv.append(f"--gres={gres}")
        argv.extend(args)
        if wrap is not None:
            argv.append(f"--wrap={wrap}")
        elif script is not None:
            argv.append(os.fspath(script))
        res = self.check(argv, input=script_text, env=env, timeout=timeout)
        # --parsable prints "JOBID" or "JOBID;CLUSTER".
        first = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
        try:
            return int(first.split(";", 1)[0])
        except ValueError:
            raise SlurmCommandError(f"sbatch printed no job id: {res.stdout!r}", argv=res.argv,
                                    returncode=res.returncode, stdout=res.stdout, stderr=res.stderr) from None

    def scancel(self, job_ids: int | str | Sequence[int | str], *, signal: str | None = None) -> None:
        """Cancel (or signal) jobs. Unknown or finished ids are not an error to Slurm's exit code."""
        ids = [job_ids] if isinstance(job_ids, (int, str)) else list(job_ids)
        if not ids:
            return
        argv = ["scancel"] + ([f"--signal={signal}"] if signal else []) + [str(i) for i in ids]
        self.check(argv)

    def scontrol_requeue(self, job_id: int | str, *, hold: bool = False) -> None:
        """Requeue a job (``requeuehold`` when ``hold``).

        Slurm 22.05 facts: a requeued batch job pends with Reason=BeginTime until
        cred_expire after the requeue (120 s by default). Do not shorten that with
        ``StartTime=now``: restarted at once on the node that still caches its
        credential, the job fails at launch (RunTime 0, seen on the local cluster
        in 2 of 6 runs); the hooks hold it back longer instead (node/epilog.py _hold_back).
        Also, ``scontrol requeue`` of a job that already COMPLETED exits 0 and runs
        it again, so only requeue jobs you know are running.
        """
        self.check(["scontrol", "requeuehold" if hold else "requeue", str(job_id)])

    def scontrol_release(self, job_id: int | str) -> None:
        """Release a held job (``scontrol release``): a user's or an admin's hold, or Slurm's own priority-0
        hold of a job it found no node for (Reason=BadConstraints), which it checks again at release."""
        self.check(["scontrol", "release", str(job_id)])

    def scontrol_reconfigure(self) -> None:
        """Make slurmctld and every slurmd re-read slurm.conf.

        This also throws away every runtime ``scontrol update ... Gres=`` change.
        """
        self.check(["scontrol", "reconfigure"])


_default = SlurmClient()


def default_client() -> SlurmClient:
    """The client used by the module-level wrappers (SLURM_CONF from the environment)."""
    return _default


def squeue_json(*, all_states: bool = False) -> dict | None:
    """``squeue --json`` via the default client (None on failure)."""
    return _default.squeue_json(all_states=all_states)


def sinfo_json() -> dict | None:
    """``sinfo --json`` via the default client (None on failure)."""
    return _default.sinfo_json()


def scontrol_show_job(job_id: int | str) -> parsers.JobDetail | None:
    """``scontrol -d show job ID`` parsed, via the default client."""
    return _default.scontrol_show_job(job_id)


def scontrol_show_nodes(node: str | None = None) -> list[parsers.SlurmNode] | None:
    """``scontrol show node`` parsed, via the default client."""
    return _default.scontrol_show_nodes(node)


def update_node_gres(node: str, counts: Mapping[str, int], *, keep_other: bool = True) -> str:
    """Set a node's mig GRES counts via the default client (see SlurmClient.update_node_gres)."""
    return _default.update_node_gres(node, counts, keep_other=keep_other)


def sbatch(script: str | os.PathLike | None = None, **kwargs) -> int:
    """Submit a batch job via the default client; returns the job id."""
    return _default.sbatch(script, **kwargs)


def scancel(job_ids: int | str | Sequence[int | str], *, signal: str | None = None) -> None:
    """Cancel jobs via the default client."""
    _default.scancel(job_ids, signal=signal)


def scontrol_requeue(job_id: int | str, *, hold: bool = False) -> None:
    """Requeue a job via the default client (see SlurmClient.scontrol_requeue)."""
    _default.scontrol_requeue(job_id, hold=hold)


def scontrol_reconfigure() -> None:
    """``scontrol reconfigure`` via the default client."""
    _default.scontrol_reconfigure()
