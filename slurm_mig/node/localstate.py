"""A node's own records: which job holds which MIG instance, and messages owed to the controller.

Prolog writes a binding file per job; TaskProlog (running as the job's user)
reads it to set CUDA_VISIBLE_DEVICES; Epilog removes it. These files are the
node's authority on what is in use, so layout changes on the node never touch
a bound instance even when the controller is unreachable. Messages that could
not reach the controller (outcomes above all) wait in the outbox and are sent
by the next hook or health check, so an outcome is never lost.

Permissions: root hooks trust only ``records/<job>.json`` (root, 0600, in a
0700 folder). The TaskProlog runs as the job's user, so it reads a copy,
``bindings/<job>.json``, owned by root with the job's group and mode 0440: the
user can read it but, not owning it, cannot chmod or rewrite it (the folder is
0711 root: others may open a file whose name they know, not list or replace it).
Before this split the one binding file belonged to the job's user (0400), who
could chmod it and claim other jobs' instances; such files are adopted once by
``ensure`` (a node upgraded with jobs running keeps their bindings).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_mig.folders import make_missing_folders
# every record, copy and outbox message: temp file, fsync, rename, folder fsync (hooks import it from here too)
from slurm_mig.folders import write_durably as _atomic_write  # noqa: F401

log = logging.getLogger("slurm_mig.hooks")

#: The largest binding file root hooks will parse: a binding names a few instances (well under 1 KiB),
#: so anything bigger is damaged or hostile and is refused rather than read into memory.
MAX_BINDING_BYTES = 64 * 1024
#: Outbox messages carry whole GPU observations; the controller refuses bodies over 1 MiB anyway.
MAX_MESSAGE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class BoundInstance:
    gpu: int
    profile: str
    start: int
    uuid: str

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "profile": self.profile, "start": self.start, "uuid": self.uuid}

    @classmethod
    def from_json(cls, d: dict) -> "BoundInstance":
        """Raises ValueError for anything that is not an instance record."""
        try:
            return cls(int(d["gpu"]), str(d["profile"]), int(d["start"]), str(d["uuid"]))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"not a bound instance: {d!r:.200}") from exc


@dataclass(frozen=True)
class NamedInstances:
    """What some binding records name (NodeState.named_by_others): ``uuids`` and ``slots`` (GPU, profile, start),
    and ``unreadable``, the names of those records that cannot be read (they may name anything)."""
    uuids: frozenset[str]
    slots: frozenset[tuple[int, str, int]]
    unreadable: frozenset[str] = frozenset()

    def __contains__(self, inst: BoundInstance) -> bool:
        """Whether a record names ``inst``, by its UUID or by its slot."""
        return inst.uuid in self.uuids or (inst.gpu, inst.profile, inst.start) in self.slots


#: How a bounded wait for the layout lock polls (flock has no time limit): first after 5 ms, doubling to 50 ms.
LOCK_POLL_FIRST_S = 0.005
LOCK_POLL_MAX_S = 0.05


class LayoutLockBusy(TimeoutError):
    """The node's layout lock stayed held past the time a hook may wait for it (NodeState.layout_lock)."""


def _read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of ``path``; ValueError if it holds more than ``limit`` (never read whole), OSError as is."""
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes; not read")
    return data


def _read_json_object(path: Path, limit: int = MAX_BINDING_BYTES) -> dict:
    """A JSON object from ``path``; ValueError for any other content (a torn, foreign or oversized file),
    OSError as is."""
    doc = json.loads(_read_bounded(path, limit))
    if not isinstance(doc, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return doc


def _instances(doc: dict) -> list[BoundInstance]:
    items = doc.get("instances", [])
    if not isinstance(items, list):
        raise ValueError("'instances' is not a list")
    return [BoundInstance.from_json(d) for d in items]


def _safe_job_id(job_id: str) -> str:
    # Job ids become file names: only digits and '_' (array jobs) are accepted.
    job_id = str(job_id)
    if not job_id or len(job_id) > 32 or not all(c in "0123456789_" for c in job_id):
        raise ValueError(f"bad Slurm job id {job_id!r}")
    return job_id


#: The name an earlier run's binding record is kept under when the job id runs again on the node while that
#: run's processes still hold its instance: ``<job>.earlier-<n>`` (see NodeState.set_aside_earlier_run).
EARLIER_RUN = ".earlier-"


def is_earlier_run(key: str) -> bool:
    """Whether a binding key (a record's name) is an earlier run's record set aside, not a job id."""
    job, sep, n = str(key).partition(EARLIER_RUN)
    return bool(sep) and n.isascii() and n.isdigit() and job.replace("_", "").isascii() \
        and job.replace("_", "").isdigit()


def local_node_name(env: dict | None = None) -> str:
    """This node's Slurm name as the hooks take it: $SLURMD_NODENAME, else the short host name."""
    import socket

    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def identified(payload: dict) -> dict:
    """``payload`` with an id of its own (``message_id``) and the node's time (``message_at``), added once:
    every delivery of a message (a retry, the outbox re-sending one whose answer was lost) carries the
    same id, so the controller handles it once (controller.node_api.NodeMessage)."""
    if "message_id" in payload:
        return payload
    return {**payload, "message_id": secrets.token_hex(16), "message_at": time.time()}


class NodeState:
    """The binding records and outbox of one node, under ``root`` (one directory per node name)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.records_dir = self.root / "records"  # what root hooks trust
        self.bindings_dir = self.root / "bindings"  # the TaskProlog's read-only copies
        self.outbox_dir = self.root / "outbox"
        self.attempts_dir = self.root / "attempts"

    def ensure_root(self) -> "NodeState":
        """Make this node's folder if it is missing, without the hooks' folders inside it: enough to hold
        layout_lock(). Each folder made here is given its mode, whatever the umask: the node's 0711,
        ``cache_dir`` and any other above it 0755 (never writable by others, as root writes below them;
        traversable, as a job's TaskProlog reads its copy there). It is made with that mode (the umask can
        only take bits away) and then chmod-ed: made 0700 first, a hook killed between the two left
        ``cache_dir`` 0700 for good (a folder that exists is never changed here), out of every TaskProlog's
        reach. A folder another process made meanwhile (a hook's ensure) is left to it. OSError when one
        cannot be made."""
        make_missing_folders(self.root, lambda d: 0o711 if d == self.root else 0o755)
        return self

    def ensure(self) -> "NodeState":
        """Create the folders with their modes and adopt binding files an older version left. A folder made
        here is made with its mode (make_missing_folders: the umask can only take bits away), never wider even
        for a moment: made with 0777 less the umask and chmod-ed after (Path.mkdir), records/ was writable by
        anyone under umask 0 until the chmod, and a file put there then stayed a record root trusts. One that
        exists is given its mode, as root or its owner."""
        self.ensure_root()
        for d, mode in ((self.root, 0o711), (self.records_dir, 0o700), (self.bindings_dir, 0o711),
                        (self.outbox_dir, 0o700), (self.attempts_dir, 0o700)):
            if d in make_missing_folders(d, lambda _, mode=mode: mode):
                continue
            if os.geteuid() == 0 or d.stat().st_uid == os.geteuid():
                os.chmod(d, mode)
        self._adopt_legacy_bindings()
        return self

    def _adopt_legacy_bindings(self) -> None:
        """Turn each binding file without a record (written by a version that kept only the user-owned
        file) into a record plus a copy the user cannot change, so running jobs keep their bindings.

        A copy without a record is always such a file: a binding is written record first and removed
        copy first. Its content cannot be verified (its user could have rewritten it before the
        upgrade); it is adopted as it is, which is what the old version trusted too.
        """
        for copy in sorted(self.bindings_dir.glob("*.json")):
            record = self.records_dir / copy.name
            if record.exists():
                continue
            try:
                st = os.stat(copy, follow_symlinks=False)
                data = _read_bounded(copy, MAX_BINDING_BYTES)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                # Kept as a damaged record: counted as bound to nothing known, like the old file was.
                log.error("binding file %s from an older slurm-mig is unreadable (%s); adopted as damaged", copy, exc)
                st, data = None, b""
            _atomic_write(record, data, 0o600, 0, 0)
            _atomic_write(copy, data, 0o440, 0, st.st_gid if st is not None else 0)
            log.warning("adopted the binding of job %s from an older slurm-mig's user-owned file", copy.stem)

    # -- bindings ------------------------------------------------------------
    def _record_path(self, job_id: str) -> Path:
        return self.records_dir / f"{_safe_job_id(job_id)}.json"

    def _copy_path(self, job_id: str) -> Path:
        return self.bindings_dir / f"{_safe_job_id(job_id)}.json"

    def write_binding(self, job_id: str, instances: list[BoundInstance], uid: int | None = None,
                      gid: int | None = None, attempt: int | None = None) -> None:
        """Record that ``job_id`` holds ``instances``: a root-only record, then the TaskProlog's copy
        (root-owned, group ``gid``, 0440; 0400 root without a gid, which the job then cannot read).

        ``uid``: the job's user (SLURM_JOB_UID), recorded so that the next Prolog of the id can tell a record
        another user's job left (a job id reused after slurmctld lost its state) from one of its own run's
        retried Prolog; the user owns neither file.
        ``attempt``: Slurm's SLURM_JOB_RESTART_COUNT when the Prolog ran, so the Epilog can tell the run
        that made this binding from a later one (a requeue raises the count before the Epilog runs).
        """
        doc = {"job_id": str(job_id), "bound_at": time.time(), "instances": [i.to_json() for i in instances],
               "attempt": attempt, "uid": uid}
        data = json.dumps(doc).encode()
        # Record first, copy second (and removed in the other order): a copy without a record then only
        # ever comes from an older version, which is what _adopt_legacy_bindings relies on.
        _atomic_write(self._record_path(job_id), data, 0o600, 0, 0)
        if gid is None and uid is not None:
            log.warning("job %s: no group for uid %s; its TaskProlog will not be able to read its binding",
                        job_id, uid)
        _atomic_write(self._copy_path(job_id), data, 0o400 if gid is None else 0o440, 0, gid)

    def read_binding(self, job_id: str) -> list[BoundInstance] | None:
        """The job's instances from the root-only record; None without one; ValueError for a file that is
        not one (damaged, or over MAX_BINDING_BYTES)."""
        return self._read_instances(self._record_path(job_id))

    def read_task_binding(self, job_id: str) -> list[BoundInstance] | None:
        """The job's instances from the TaskProlog's copy (the only one the job's user can read). Root
        hooks never use it."""
        return self._read_instances(self._copy_path(job_id))

    @staticmethod
    def _read_instances(path: Path) -> list[BoundInstance] | None:
        try:
            doc = _read_json_object(path)
        except FileNotFoundError:
            return None
        return _instances(doc)

    def has_record(self, job_id: str) -> bool:
        """Whether ``job_id`` has a binding record (readable or not)."""
        return os.path.lexists(self._record_path(job_id))

    def attempt_noted(self, job_id: str) -> bool:
        """Whether a Prolog of ``job_id`` noted its attempt and no Epilog has taken it since."""
        return (self.attempts_dir / f"{_safe_job_id(job_id)}.json").exists()

    def set_aside_earlier_run(self, job_id: str) -> str | None:
        """Keep the binding record ``job_id``'s last run left (its processes outlived it, so its Epilog kept
        the record) under a name of its own, ``<job>.earlier-<n>``, before the id's next run binds: the
        record is the node's only word that the instance is still held, and the next run's binding would
        replace it. Every reader of the records (all_bindings, bound_slots, binding_times, so the hooks, the
        health check's report and ``nvml apply``) counts it as a job's; the health check drops it once its
        instances are idle. The TaskProlog's copy goes first: the next run's tasks must never see it.
        Returns the new name, None when there was no record. Call with layout_lock() held."""
        record = self._record_path(job_id)
        if not record.exists():
            return None
        self._copy_path(job_id).unlink(missing_ok=True)
        n = 1
        while (self.records_dir / f"{_safe_job_id(job_id)}{EARLIER_RUN}{n}.json").exists():
            n += 1
        key = f"{_safe_job_id(job_id)}{EARLIER_RUN}{n}"
        os.rename(record, self.records_dir / f"{key}.json")  # keeps its mtime: when the earlier run bound
        return key

    def read_record(self, key: str) -> list[BoundInstance] | None:
        """read_binding for any record's name: a job id or an earlier run's record (is_earlier_run)."""
        return self._read_instances(self._key_path(key))

    def remove_record(self, key: str) -> None:
        """remove_binding for any record's name (an earlier run's record has no copy)."""
        if is_earlier_run(key):
            self._key_path(key).unlink(missing_ok=True)
        else:
            self.remove_binding(key)

    def _key_path(self, key: str) -> Path:
        if is_earlier_run(key):
            return self.records_dir / f"{key}.json"
        return self._record_path(key)

    def binding_attempt(self, job_id: str) -> int | None:
        """The restart count the binding was made at (None: no record, an unreadable one, or none recorded)."""
        return self._record_int(job_id, "attempt")

    def binding_uid(self, job_id: str) -> int | None:
        """The uid of the job the binding was made for (None: no record, an unreadable one, or one written
        before records kept it)."""
        return self._record_int(job_id, "uid")

    def _record_int(self, job_id: str, key: str) -> int | None:
        try:
            value = _read_json_object(self._record_path(job_id)).get(key)
        except (OSError, ValueError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def note_attempt(self, job_id: str, attempt: int | None) -> None:
        """The Prolog's first act: which attempt of the job (SLURM_JOB_RESTART_COUNT) it runs for, so the
        Epilog can tell that this attempt was requeued even if the Prolog died before binding anything."""
        _atomic_write(self.attempts_dir / f"{_safe_job_id(job_id)}.json", json.dumps({"attempt": attempt}).encode(),
                      0o600)

    def take_attempt(self, job_id: str) -> int | None:
        """The attempt the last Prolog of ``job_id`` noted (and forget it); None if there is none."""
        path = self.attempts_dir / f"{_safe_job_id(job_id)}.json"
        try:
            attempt = _read_json_object(path).get("attempt")
        except (OSError, ValueError):
            attempt = None
        path.unlink(missing_ok=True)
        return attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None

    def remove_binding(self, job_id: str) -> None:
        """Forget the job's binding: its copy first, then its record (see write_binding)."""
        for path in (self._copy_path(job_id), self._record_path(job_id)):
            path.unlink(missing_ok=True)

    def all_bindings(self, *, strict: bool = False) -> dict[str, list[BoundInstance]]:
        """Every job bound on this node; unreadable/corrupt records count as bound to nothing known.

        ``strict``: for a tool that changes layouts without a controller's view of the node (``nvml
        apply``), which cannot know what such a record's job holds: an unreadable records folder or
        record raises BindingsUnreadable instead. A missing folder is no binding in either mode, and a
        record removed while it is read (an Epilog) is skipped.
        """
        return {key: insts or [] for key, insts in self._read_records(strict).items()}

    def _read_records(self, strict: bool = False) -> dict[str, list[BoundInstance] | None]:
        """all_bindings, with None for a record that cannot be read (not strict)."""
        out: dict[str, list[BoundInstance] | None] = {}
        for path in self._record_paths(strict):
            try:
                out[path.stem] = _instances(_read_json_object(path))
            except (OSError, ValueError) as exc:
                if strict and isinstance(exc, FileNotFoundError):
                    continue
                if strict:
                    from slurm_mig.errors import BindingsUnreadable

                    raise BindingsUnreadable(f"the binding record of job {path.stem} ({path}) is unreadable: "
                                             f"{getattr(exc, 'strerror', None) or exc}") from exc
                log.error("binding record %s unreadable (%s); counted as bound to nothing known", path, exc)
                out[path.stem] = None
        return out

    def named_by_others(self, key: str) -> "NamedInstances":
        """The instances the records other than ``key`` (a job id or an earlier run's record) name, by UUID and by
        slot, and which of those records cannot be read. By slot as well: the simulated GPU keeps its "job <id>"
        marks by slot, and a record may name an instance made again since (another UUID) at a slot another
        record's run holds. The one guard of every step that clears a job's marks on instances no other record
        names (the Prolog replacing its own binding, the health check releasing an earlier run's record, a
        damaged record's marks found by their owner)."""
        uuids, slots, unreadable = set(), set(), set()
        for other, insts in self._read_records().items():
            if other == str(key):
                continue
            if insts is None:
                unreadable.add(other)
            for i in insts or []:
                uuids.add(i.uuid)
                slots.add((i.gpu, i.profile, i.start))
        return NamedInstances(frozenset(uuids), frozenset(slots), frozenset(unreadable))

    def _record_paths(self, strict: bool) -> list[Path]:
        if not strict:
            return sorted(self.records_dir.glob("*.json")) if self.records_dir.exists() else []
        # Not glob: it yields nothing for a folder it cannot list, which would read as "no bindings".
        try:
            names = [e.name for e in os.scandir(self.records_dir) if e.name.endswith(".json")]
        except FileNotFoundError:
            return []
        except OSError as exc:
            from slurm_mig.errors import BindingsUnreadable

            raise BindingsUnreadable(f"cannot list the binding records in {self.records_dir}: "
                                     f"{exc.strerror or exc}") from exc
        return [self.records_dir / n for n in sorted(names)]

    @contextlib.contextmanager
    def layout_lock(self, timeout_s: float | None = None):
        """Hold this node's layout lock (``<root>/apply.lock``): the hooks change layouts and write
        bindings under it, so a holder sees every binding and no Prolog binds meanwhile. The folder
        must exist (see ensure).

        ``timeout_s``: wait at most this long (0: try once), then raise LayoutLockBusy; None waits for as
        long as the holder keeps it. flock has no time limit of its own, so a bounded wait polls, every
        5 ms at first and then every 50 ms: a waiter takes the lock at most 50 ms after it is let go."""
        import fcntl

        fd = os.open(self.root / "apply.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if timeout_s is None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            else:
                deadline, pause = time.monotonic() + max(0.0, timeout_s), LOCK_POLL_FIRST_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise LayoutLockBusy(f"the node's layout lock ({self.root / 'apply.lock'}) stayed "
                                                 f"held by another process for {max(0.0, timeout_s):g} s") from None
                        time.sleep(min(pause, left))
                        pause = min(pause * 2, LOCK_POLL_MAX_S)
            yield
        finally:
            os.close(fd)

    def binding_times(self) -> dict[str, float]:
        """Job id -> when its binding record was last written (mtime), for every record."""
        out = {}
        if self.records_dir.exists():
            for path in self.records_dir.glob("*.json"):
                try:
                    out[path.stem] = path.stat().st_mtime
                except OSError:
                    pass
        return out

    def bound_slots(self) -> dict[int, set[tuple[str, int]]]:
        """GPU index -> {(profile, start)} held by some job on this node."""
        held: dict[int, set[tuple[str, int]]] = {}
        for insts in self.all_bindings().values():
            for i in insts:
                held.setdefault(i.gpu, set()).add((i.profile, i.start))
        return held

    # -- outbox --------------------------------------------------------------
    def enqueue(self, path: str, payload: dict) -> Path:
        """Keep a message for the controller until it can be delivered (at-least-once; the controller dedupes
        by the message's id, see :func:`identified`)."""
        name = f"{time.time_ns():020d}-{os.getpid()}.json"
        target = self.outbox_dir / name
        _atomic_write(target, json.dumps({"path": path, "payload": identified(payload)}).encode(), 0o600)
        return target

    def pending_messages(self) -> list[tuple[Path, str, dict]]:
        out = []
        if not self.outbox_dir.exists():
            return out
        for p in sorted(self.outbox_dir.glob("*.json")):
            try:
                doc = _read_json_object(p, MAX_MESSAGE_BYTES)
                if not isinstance(doc.get("path"), str) or not isinstance(doc.get("payload"), dict):
                    raise ValueError("not an outbox message")
                out.append((p, doc["path"], doc["payload"]))
            except (OSError, ValueError):
                # A torn write from a crash: keep it aside for an admin instead of dropping it.
                try:
                    p.rename(p.with_suffix(".corrupt"))
                except OSError:
                    pass
        return out

    def queued_about(self, job_id: str) -> bool:
        """Whether a message about ``job_id`` (its ``job_id``) waits in the outbox: a hook must not send its
        own about that job before it (it would overtake it; see Node.send_or_queue)."""
        return any(str(payload.get("job_id")) == str(job_id) for _p, _r, payload in self.pending_messages())

    def flush(self, client, budget_s: float | None = None) -> int:
        """Send queued messages in order; stop at the first failure. Returns how many were delivered.

        ``budget_s``: start no message once this many seconds have passed since the flush began (the one
        under way is finished: at most the client's timeout, twice with its retry); the rest stay queued,
        in order, for the next flush. None: send them all.

        One process flushes at a time (a hook and the health check may overlap): another one finding
        the outbox busy leaves it to that flush, or the next, rather than sending the same messages
        twice in parallel and tripping over each other's deletions.
        """
        import fcntl

        from slurm_mig.api.client import ControllerRefused

        if not self.outbox_dir.exists():
            return 0
        fd = os.open(self.root / "outbox.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            sent, t0 = 0, time.monotonic()
            for path, route, payload in self.pending_messages():
                if budget_s is not None and time.monotonic() - t0 >= budget_s:
                    break
                try:
                    client.call(route, payload)
                except ControllerRefused:
                    # The controller understood and refused: retrying will not help; keep it for an admin.
                    path.rename(path.with_suffix(".refused"))
                    continue
                path.unlink(missing_ok=True)
                sent += 1
            return sent
        finally:
            os.close(fd)
