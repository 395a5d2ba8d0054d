"""Pure parsers for Slurm command output (no Slurm needed to run them).

Written against Slurm 22.05 (openapi v0.0.38 JSON for ``squeue --json`` and
``sinfo --json``; ``scontrol`` has no JSON there) and tolerant of the other
releases' shapes: a missing field becomes ``None``/empty, ``job_state`` may be
a string or a list, numbers may be plain or ``{"set", "infinite", "number"}``
objects (23.02+), and GRES requests may be spelled ``gres:mig:3g:1`` (22.05),
``gres/mig:3g:1`` (later) or sit in an older ``gres`` field.

Things learned from the real 22.05 output (see tests/test_slurm_parsers.py):

* ``scontrol show node`` prints ``GresUsed`` only with ``-d``; ``sinfo --json``
  always has ``gres`` and ``gres_used``.
* ``JOB_GRES`` in ``scontrol -d show job`` is the job's total over all nodes
  (``mig:1g:4`` for ``-N2 --gres=mig:1g:2``); the per-node split is in the
  indented ``Nodes=.. GRES=mig:1g(CNT:2)`` lines and in ``TresPerNode``.
* A job without a time limit reports ``time_limit`` 525600 (365 days) while
  running but ``null`` while pending, and ``TimeLimit=UNLIMITED`` in scontrol.
* Spaces in a pending reason become underscores in scontrol
  (``ReqNodeNotAvail,_UnavailableNodes:n3``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from slurm_mig.slurm.gres import GRES_NAME, parse_gres_item, parse_node_gres, split_gres

# -- small helpers -----------------------------------------------------------


def _num(value: Any) -> int | None:
    """A number from 22.05 (plain) or 23.02+ ({"set":..,"infinite":..,"number":..}) JSON."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, dict):
        if value.get("infinite"):
            return None
        if value.get("set") is False:
            return None
        value = value.get("number")
        if value is None:
            return None
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON "1e400" reads back as inf
        return None


def _str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def expand_hostlist(expr: str | None) -> list[str]:
    """Expand a Slurm hostlist: ``"n[1-3,5],gpu01"`` -> ``["n1", "n2", "n3", "n5", "gpu01"]``.

    Handles one bracket group per name with ranges (zero padding kept), which
    is what Slurm prints for node lists. ``""``/``None``/``"(null)"`` give ``[]``.
    A group that is not such a list (``"n[1-x]"``, a huge range) is kept as one
    name, unexpanded: never an exception.
    """
    if not expr or expr in ("(null)", "None", "N/A"):
        return []
    out: list[str] = []
    parts, depth, cur = [], 0, []
    for ch in expr:  # split on commas outside brackets
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    for part in (p.strip() for p in parts):
        if not part:
            continue
        m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)", part)
        if not m:
            out.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        expanded: list[str] = []
        for rng in ranges.split(","):
            lo, dash, hi = rng.partition("-")
            if not rng.strip():
                expanded = [part]
                break
            if not dash:
                expanded.append(f"{prefix}{rng}{suffix}")
                continue
            if not (re.fullmatch(r"[0-9]{1,9}", lo) and re.fullmatch(r"[0-9]{1,9}", hi)) \
                    or int(hi) - int(lo) > _MAX_HOSTLIST_RANGE:
                expanded = [part]  # not a range Slurm prints: keep the text, do not guess
                break
            width = len(lo) if lo.startswith("0") else 0
            expanded.extend(f"{prefix}{str(i).zfill(width)}{suffix}" for i in range(int(lo), int(hi) + 1))
        out.extend(expanded)
    return out


#: A range wider than this in a hostlist is kept as text (a mangled "n[1-999999999]" must not
#: allocate a billion names); the largest Slurm clusters have a few tens of thousands of nodes.
_MAX_HOSTLIST_RANGE = 100_000


def mig_request(tres_per_node: str | None) -> dict[str, int]:
    """The per-node MIG request of a job: ``"gres:mig:3g:2,gres:foo:1"`` -> ``{"3g": 2}``.

    Items that are not ``mig`` or have no type (e.g. an unrewritten ``mig:2``)
    are left out; unparsable counts are skipped.
    """
    out: dict[str, int] = {}
    for item in split_gres(tres_per_node):
        try:
            name, gtype, n = parse_gres_item(item)
        except ValueError:
            continue
        if name == GRES_NAME and gtype:
            out[gtype] = out.get(gtype, 0) + n
    return out


_TASK_RANGE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9})(?::([0-9]{1,9}))?)?")


def array_task_ids(spec: str, limit: int) -> list[int] | None:
    """The first ``limit`` task ids of a job array's task expression, in order; None when unreadable.

    Slurm prints them as squeue's ``array_task_string``: "1-12", "3-12%2" (a throttle), "1,4,7-9",
    "0-99:3" (a step). A long expression is cut short with "..." (squeue's SLURM_BITSTR_LEN, 64
    characters by default): the ids before the cut are returned, the one it splits is dropped.
    """
    text = (spec or "").split("%")[0].strip()
    parts = text.split(",")
    if "..." in text:
        # Cut at a character count: the piece the cut went through may be a partial number.
        parts = text.split("...")[0].split(",")[:-1]
        if not parts:
            return []
    elif not text:
        return None
    ids: list[int] = []
    for part in parts:
        m = _TASK_RANGE.fullmatch(part.strip())
        if m is None:
            return None
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        step = int(m.group(3)) if m.group(3) is not None else 1
        if last < first or step < 1:
            return None
        for t in range(first, last + 1, step):
            if len(ids) >= limit:
                return ids
            ids.append(t)
    return ids


def parse_step_mig_request(text: str) -> dict[str, int] | None:
    """The per-node mig request of a job step, from ``scontrol -d show step J.S`` (its ``TresPerNode``:
    "gres:mig:1g:1"); None when the step shows none. Slurm 22.05 gives a step run without ``--gres`` the
    job's request, and one run with ``--gres=none`` no TresPerNode at all; None is read as "not known"."""
    m = re.search(r"(?:^|\s)TresPerNode=(\S+)", text or "")
    if m is None:
        return None
    return mig_request(m.group(1)) or None


def wait_status(exit_code: str | None) -> int | None:
    """The wait status (what SLURM_JOB_EXIT_CODE holds, and the store keeps) of Slurm's ``ExitCode=3:0``
    ("exit:signal"); None when it is not of that form."""
    code, _, sig = (exit_code or "").partition(":")
    if code.isascii() and code.isdigit() and sig.isascii() and sig.isdigit():
        return (int(code) << 8) | int(sig)
    return None


def format_exit_status(status: int | None) -> str:
    """A wait status as Slurm prints it, "exit:signal": 768 -> "3:0" (exit 3), 9 -> "0:9" (SIGKILL)."""
    if status is None:
        return "unknown"
    return f"{(status >> 8) & 0xFF}:{status & 0x7F}"


def _detail_gres(value: str | None) -> dict[str, int]:
    """``mig:1g(CNT:2),mig:3g(IDX:0-1)`` (job GRES detail) -> ``{"1g": 2, "3g": 2}``."""
    out: dict[str, int] = {}
    for item in split_gres(value):
        m = re.fullmatch(r"([^:()]+)(?::([^:()]+))?(?::(\d+))?(?:\(([^)]*)\))?", item.strip())
        if not m:
            continue
        name, gtype, cnt, detail = m.groups()
        if name != GRES_NAME or not gtype:
            continue
        n = int(cnt) if cnt else None
        if detail:
            cm = re.search(r"CNT:(\d+)", detail)
            if cm:
                n = int(cm.group(1))
            elif n is None:
                im = re.search(r"IDX:([\d,\-]+)", detail)
                if im:
                    n = len(expand_hostlist(f"x[{im.group(1)}]"))
        out[gtype] = out.get(gtype, 0) + (n if n is not None else 1)
    return out


# -- node state ------------------------------------------------------------------

_STATE_SUFFIX_FLAGS = {"*": "NOT_RESPONDING", "~": "POWERED_DOWN", "#": "POWERING_UP",
                       "%": "POWERING_DOWN", "!": "POWER_DOWN", "@": "REBOOT_REQUESTED",
                       "$": "MAINTENANCE", "^": "REBOOT_ISSUED", "-": "PLANNED"}
# sinfo's long state names that fold a flag into the name.
_LONG_STATES = {"drained": ("idle", {"DRAIN"}), "draining": ("allocated", {"DRAIN"}),
                "drng": ("allocated", {"DRAIN"}), "drain": ("idle", {"DRAIN"}),
                "alloc": ("allocated", set()), "mix": ("mixed", set()), "comp": ("completing", set()),
                "unk": ("unknown", set()), "resv": ("reserved", set()), "maint": ("maint", set())}


def parse_node_state(state: str | list | None, flags: list | None = None) -> tuple[str, frozenset[str]]:
    """Split a node state into ``(base, flags)``, base lower case, flags upper case.

    Accepts scontrol's ``IDLE+DRAIN`` / ``DOWN*``, sinfo's ``drained`` / ``idle*``,
    22.05 JSON (``"idle"`` plus ``state_flags``) and 23.02+ JSON (``["IDLE", "DRAIN"]``).
    """
    parts: list[str] = []
    if isinstance(state, list):
        parts = [str(s) for s in state]
    elif state:
        parts = str(state).split("+")
    fl = {str(f).upper() for f in (flags or [])}
    base = ""
    for i, p in enumerate(parts):
        p = p.strip()
        while p and p[-1] in _STATE_SUFFIX_FLAGS:
            fl.add(_STATE_SUFFIX_FLAGS[p[-1]])
            p = p[:-1]
        if i == 0:
            base = p.lower()
        elif p:
            fl.add(p.upper())
    if base in _LONG_STATES:
        base, extra = _LONG_STATES[base]
        fl |= extra
    if base.upper() in ("DRAIN", "NOT_RESPONDING"):  # a list whose first item is a flag
        fl.add(base.upper())
        base = ""
    return base or "unknown", frozenset(fl)


# -- records -------------------------------------------------------------------------


@dataclass
class SlurmNode:
    """One node as the parsers see it (from sinfo --json or scontrol show node)."""

    name: str
    state: str  # base state, lower case: idle, mixed, allocated, down, unknown, future ...
    flags: frozenset[str] = frozenset()  # DRAIN, NOT_RESPONDING, INVALID_REG, ...
    gres: dict[str, int] = field(default_factory=dict)  # mig type -> configured count
    gres_used: dict[str, int] | None = None  # mig type -> allocated count, when known
    gres_raw: str = ""
    reason: str = ""
    partitions: list[str] = field(default_factory=list)
    cpus: int | None = None
    alloc_cpus: int | None = None
    address: str = ""  # NodeAddr: where slurmctld reaches the node (an address or a host name)
    hostname: str = ""  # NodeHostname
    features: frozenset[str] = frozenset()  # active features (what --constraint matches)
    # When the node's slurmd last started (epoch seconds); None when not known. A slurmd start registers
    # the node, and a registration puts slurm.conf's Gres mix back (FACTS.md section 4).
    slurmd_start_time: float | None = None

    @property
    def drained(self) -> bool:
        """DRAIN is set (drained or draining)."""
        return "DRAIN" in self.flags

    @property
    def responding(self) -> bool:
        """slurmd answers (no ``*``/NOT_RESPONDING)."""
        return "NOT_RESPONDING" not in self.flags

    @property
    def available(self) -> bool:
        """Up, responding, not drained: the scheduler may place jobs here."""
        return (self.state in ("idle", "mixed", "allocated", "completing") and self.responding
                and not self.drained and "INVALID_REG" not in self.flags)

    @property
    def gres_free(self) -> dict[str, int] | None:
        """Configured minus used per type, when usage is known."""
        if self.gres_used is None:
            return None
        return {t: self.gres.get(t, 0) - self.gres_used.get(t, 0) for t in self.gres}


@dataclass
class SlurmJob:
    """One job from ``squeue --json``."""

    job_id: int
    name: str = ""
    user: str = ""
    user_id: int | None = None
    state: str = ""  # upper case base state: PENDING, RUNNING, COMPLETING, COMPLETED ...
    state_reason: str = ""
    partition: str = ""
    nodes: list[str] = field(default_factory=list)
    node_count: int | None = None
    mig: dict[str, int] = field(default_factory=dict)  # per-node mig request
    tres_per_node: str = ""
    submit_time: int | None = None
    start_time: int | None = None  # epoch seconds; None when not (yet) known
    end_time: int | None = None  # epoch seconds: when it ended (an ended job), or its limit's end (a running one)
    time_limit_min: int | None = None  # None = no limit / unknown
    priority: int | None = None
    array_job_id: int | None = None
    array_task_id: int | None = None
    # A job array's tasks Slurm has not split off yet share one pending record: its task ids ("3-12%2").
    array_task_string: str = ""
    array_max_tasks: int | None = None  # the throttle ("%2"); None: none
    flags: list[str] = field(default_factory=list)
    # Where Slurm may start it, besides its partitions: --nodelist, --exclude, --constraint, --reservation.
    required_nodes: list[str] = field(default_factory=list)
    excluded_nodes: list[str] = field(default_factory=list)
    features: str = ""  # the --constraint expression, as Slurm keeps it ("fast&nvlink")
    reservation: str = ""
    cpus: int | None = None  # CPUs it asks for (-n x -c; a MIG job runs on one node)
    exclusive: bool = False  # --exclusive: a node with no CPU allocated to another job
    # How often Slurm requeued it (restart_cnt): a requeued batch job gets a new submit time, a new job none.
    restart_cnt: int = 0
    # `scontrol suspend` / `resume` (and gang or suspend preemption), as slurmctld keeps them: ``suspend_time`` is
    # when the job was last suspended or resumed (None: never), ``pre_sus_time`` the seconds it ran before that
    # (its run time so far while suspended). Slurm does not count suspended time against the time limit.
    suspend_time: int | None = None
    pre_sus_time: int | None = None

    @property
    def pending(self) -> bool:
        """True while the job waits to start."""
        return self.state == "PENDING"

    @property
    def held(self) -> bool:
        """Pending with priority 0: held by user/admin, or BadConstraints (Slurm holds those)."""
        return self.pending and self.priority == 0

    @property
    def wants_mig(self) -> bool:
        """The job asks for at least one MIG instance."""
        return bool(self.mig)

    @property
    def suspended_before_s(self) -> float | None:
        """Seconds this run was suspended before its last suspend or resume: ``suspend_time - start_time -
        pre_sus_time`` (0 for a job never suspended; None when Slurm gave no ``pre_sus_time`` or no start).

        What squeue's TIME column and scontrol's RunTime count (squeue's job_time_used): a suspended job's
        run time is ``pre_sus_time``; once resumed it is ``now - suspend_time + pre_sus_time``; never suspended,
        ``now - start_time``. So a resumed job has been suspended for this many seconds, and a suspended one
        for this many plus the time since ``suspend_time``. A ``suspend_time`` before the start is an earlier
        run's (Slurm clears both on requeue): 0.
        """
        if self.start_time is None or self.pre_sus_time is None:
            return None
        if self.suspend_time is None or self.suspend_time < self.start_time:
            return 0.0
        return float(max(0, self.suspend_time - self.start_time - self.pre_sus_time))


def _job_state(value: Any) -> tuple[str, list[str]]:
    if isinstance(value, list):
        names = [str(v).upper() for v in value]
        return (names[0] if names else ""), names[1:]
    s = _str(value).upper()
    return s, []


def _epoch(value: Any) -> int | None:
    n = _num(value)
    return n if n else None  # Slurm writes 0 for "not set"


def json_errors(doc: dict) -> list[str]:
    """The ``errors`` a squeue/sinfo JSON document reports, as readable strings.

    22.05 exits 0 when slurmctld is unreachable and says so only here
    (``{"error": "Unspecified error", "errno": -1}`` and an empty list).
    """
    out = []
    for e in doc.get("errors") or []:
        if isinstance(e, dict):
            text = " ".join(str(e[k]) for k in ("source", "description", "error") if e.get(k))
            out.append(text or str(e))
        else:
            out.append(str(e))
    return out


def parse_squeue_json(doc: dict) -> list[SlurmJob]:
    """Jobs from a decoded ``squeue --json`` document (missing fields tolerated)."""
    jobs = []
    for j in doc.get("jobs") or []:
        if not isinstance(j, dict):
            continue
        job_id = _num(j.get("job_id"))
        if job_id is None:
            continue
        state, extra_flags = _job_state(j.get("job_state"))
        tres = _str(j.get("tres_per_node"))
        if not tres and j.get("gres"):  # 21.08 and older put --gres here
            tres = _str(j.get("gres"))
        jobs.append(SlurmJob(
            job_id=job_id,
            name=_str(j.get("name")),
            user=_str(j.get("user_name")) or (str(j["user_id"]) if j.get("user_id") is not None else ""),
            user_id=_num(j.get("user_id")),
            state=state,
            state_reason=_null(_str(j.get("state_reason"))),
            partition=_str(j.get("partition")),
            nodes=expand_hostlist(_str(j.get("nodes"))),
            node_count=_num(j.get("node_count")),
            mig=mig_request(tres),
            tres_per_node=tres,
            submit_time=_epoch(j.get("submit_time")),
            start_time=_epoch(j.get("start_time")),
            end_time=_epoch(j.get("end_time")),
            time_limit_min=_num(j.get("time_limit")),
            priority=_num(j.get("priority")),
            array_job_id=_num(j.get("array_job_id")) or None,
            array_task_id=_num(j.get("array_task_id")),
            array_task_string=_str(j.get("array_task_string")),
            array_max_tasks=_num(j.get("array_max_tasks")) or None,
            flags=[str(f) for f in (j.get("flags") or [])] + extra_flags,
            required_nodes=expand_hostlist(_str(j.get("required_nodes"))),
            excluded_nodes=expand_hostlist(_str(j.get("excluded_nodes"))),
            features=_null(_str(j.get("features"))),
            reservation=_null(_str(j.get("resv_name"))),
            cpus=_num(j.get("cpus")),
            # 22.05 writes "none" for --exclusive ("user", "mcs", "oversubscribe" otherwise), 23.02+ a list
            exclusive="none" in _str(j.get("shared")).lower().split(","),
            restart_cnt=_num(j.get("restart_cnt")) or 0,
            suspend_time=_epoch(j.get("suspend_time")),
            pre_sus_time=_num(j.get("pre_sus_time")),
        ))
    return jobs


def parse_sinfo_json(doc: dict) -> list[SlurmNode]:
    """Nodes from a decoded ``sinfo --json`` document."""
    nodes = []
    for n in doc.get("nodes") or []:
        if not isinstance(n, dict):
            continue
        name = _str(n.get("name") or n.get("hostname"))
        if not name:
            continue
        base, flags = parse_node_state(n.get("state"), n.get("state_flags"))
        gres_raw = _str(n.get("gres"))
        used_raw = n.get("gres_used")
        nodes.append(SlurmNode(
            name=name, state=base, flags=flags,
            gres=parse_node_gres(gres_raw), gres_raw=gres_raw,
            gres_used=parse_node_gres(_str(used_raw)) if used_raw is not None else None,
            reason=_str(n.get("reason")),
            partitions=[str(p) for p in (n.get("partitions") or [])],
            cpus=_num(n.get("cpus")), alloc_cpus=_num(n.get("alloc_cpus")),
            address=_str(n.get("address")), hostname=_str(n.get("hostname")),
            features=_feature_set(n.get("active_features") if "active_features" in n else n.get("features")),
            slurmd_start_time=_epoch(n.get("slurmd_start_time")),
        ))
    return nodes


# -- scontrol key=value text --------------------------------------------------------

# A key starts a line or follows whitespace; keys may contain ':' and '/'
# (ReqB:S:C:T=, CPUs/Task=). "TRES=cpu=1,node=1" stays one value because
# "cpu" follows "=", not whitespace.
_KEY_RE = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/]*)=", re.M)


#: Fields of ``scontrol show job`` (multi-line form) that print what the job's user gave, verbatim: the job
#: name, script, paths and comments. Each is printed at the end of its own line (JobName ends the first one),
#: or before the one key named here, so its value runs to there: a name such as
#: ``x TresPerNode=gres:mig:7g:1 NodeList=n9`` is a name, not a MIG request (Slurm prints it with
#: ``JobName=%s`` and the others the same way, in scontrol show job's job_info printer).
JOB_FREE_TEXT: dict[str, str | None] = {
    "JobName": None, "Command": None, "WorkDir": None, "AdminComment": None, "SystemComment": None,
    "Comment": None, "Extra": None, "StdErr": None, "StdIn": None, "StdOut": None,
    "MailUser": "MailType", "Container": "ContainerID",
}


def parse_kv(text: str, free_text: dict[str, str | None] | None = None) -> list[tuple[str, str]]:
    """Split scontrol ``Key=Value Key=Value ...`` text into ordered pairs.

    Values run to the next key, so values with spaces (``Reason=...``,
    ``OS=Linux 6.1 #1 SMP``) survive. A value that itself contains
    `` word=`` would be split, unless its key is in ``free_text`` and ``text``
    is scontrol's multi-line form: such a value runs to the end of its line
    (or to the last `` <stop key>=`` on it) and holds no keys. In the one-line
    (``-o``) form there is no telling a value's end: never read one a user
    writes there.
    """
    pairs = []
    matches = list(_KEY_RE.finditer(text))
    multiline = "\n" in text.strip("\n")
    i = 0
    while i < len(matches):
        m = matches[i]
        key = m.group(1)
        if free_text and multiline and key in free_text:
            eol = text.find("\n", m.end())
            end = len(text) if eol < 0 else eol
            stop = free_text[key]
            if stop:
                at = text.rfind(f" {stop}=", m.end(), end)
                end = end if at < 0 else at
            pairs.append((key, text[m.end():end].strip()))
            i += 1
            while i < len(matches) and matches[i].start() < end:
                i += 1  # a key inside the value is part of the value
            continue
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        pairs.append((key, text[m.end():end].strip()))
        i += 1
    return pairs


def _first_values(text: str) -> dict[str, str]:
    """``Key=Value`` pairs of scontrol text; a key given twice keeps its first value."""
    kv: dict[str, str] = {}
    for k, v in parse_kv(text):
        kv.setdefault(k, v)
    return kv


def _records(text: str, first_key: str) -> list[str]:
    """Split scontrol output into one chunk per record (multi-line or ``-o``)."""
    starts = [m.start() for m in re.finditer(rf"(?m)^{re.escape(first_key)}=", text)]
    return [text[s:e] for s, e in zip(starts, starts[1:] + [len(text)])]


def _null(v: str | None) -> str:
    return "" if v in (None, "(null)", "N/A", "None") else v


# How far ahead of this host's clock a time Slurm printed may be and still be taken for one that has passed:
# the controller's default clock margin (twice [auth].max_clock_skew_s's default, 30 s).
PAST_SKEW_S = 60.0


def parse_scontrol_nodes(text: str, *, now: float | None = None) -> list[SlurmNode]:
    """Nodes from ``scontrol [-d] [-o] show node`` text, read at ``now`` (this host's clock by default).

    ``SlurmdStartTime`` has passed when scontrol prints it: in the hour the clock goes back, of the two
    instants its local time names, the later one not after ``now`` (PAST_SKEW_S allowed for slurmd's clock),
    where mktime's guess, following its previous call, could put the start an hour early or in the future."""
    not_after = (time.time() if now is None else now) + PAST_SKEW_S
    nodes = []
    for chunk in _records(text, "NodeName"):
        kv = _first_values(chunk)
        base, flags = parse_node_state(kv.get("State"))
        gres_raw = _null(kv.get("Gres"))
        reason = _null(kv.get("Reason"))
        # "Reason=text [user@time]": keep the text only.
        reason = re.sub(r"\s*\[[^\]]*@[^\]]*\]$", "", reason)
        nodes.append(SlurmNode(
            name=kv.get("NodeName", ""), state=base, flags=flags,
            gres=parse_node_gres(gres_raw), gres_raw=gres_raw,
            gres_used=parse_node_gres(_null(kv["GresUsed"])) if "GresUsed" in kv else None,
            reason=reason,
            partitions=[p for p in _null(kv.get("Partitions")).split(",") if p],
            cpus=_num(kv.get("CPUTot")), alloc_cpus=_num(kv.get("CPUAlloc")),
            address=_null(kv.get("NodeAddr")), hostname=_null(kv.get("NodeHostName")),
            features=_feature_set(_null(kv.get("ActiveFeatures", kv.get("AvailableFeatures")))),
            slurmd_start_time=local_epoch(_null(kv.get("SlurmdStartTime")), not_after=not_after),
        ))
    return nodes


def _feature_set(value: Any) -> frozenset[str]:
    """Node features from ``"fast,nvlink"`` (22.05 JSON, scontrol) or ``["fast", "nvlink"]`` (23.02+ JSON)."""
    return frozenset(f.strip() for f in _null(_str(value)).split(",") if f.strip())


@dataclass
class JobDetail:
    """One job from ``scontrol -d show job``."""

    job_id: int
    name: str = ""
    user: str = ""
    state: str = ""
    reason: str = ""
    partition: str = ""
    nodes: list[str] = field(default_factory=list)
    batch_host: str = ""
    num_nodes: int | None = None
    priority: int | None = None
    time_limit: str = ""  # as printed: "00:30:00", "365-00:00:00", "UNLIMITED"
    tres_per_node: str = ""
    mig: dict[str, int] = field(default_factory=dict)  # per-node request
    job_gres_raw: str = ""
    job_gres: dict[str, int] = field(default_factory=dict)  # allocated, total over nodes
    node_gres: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> allocated
    fields: dict[str, str] = field(default_factory=dict)  # every top-level Key=Value

    @property
    def held(self) -> bool:
        """Pending with priority 0 (user/admin hold, or Slurm's BadConstraints hold)."""
        return self.state == "PENDING" and self.priority == 0


def parse_scontrol_jobs(text: str) -> list[JobDetail]:
    """Jobs from ``scontrol [-d] [-o] show job`` text."""
    jobs = []
    for chunk in _records(text, "JobId"):
        kv: dict[str, str] = {}
        node_gres: dict[str, dict[str, int]] = {}
        detail: dict[str, str] | None = None
        for k, v in parse_kv(chunk, JOB_FREE_TEXT):
            # "-d" adds "Nodes=n1 CPU_IDs=0 Mem=0 GRES=mig:3g(CNT:1)" groups.
            if k == "Nodes":
                detail = {}
                for node in expand_hostlist(v):
                    node_gres.setdefault(node, {})
                detail["Nodes"] = v
                continue
            if detail is not None and k in ("CPU_IDs", "Mem", "GRES"):
                if k == "GRES":
                    for node in expand_hostlist(detail["Nodes"]):
                        node_gres[node] = _detail_gres(v)
                continue
            detail = None
            kv.setdefault(k, v)
        job_id = _num(kv.get("JobId"))
        if job_id is None:
            continue
        job_gres_raw = _null(kv.get("JOB_GRES"))
        tres = _null(kv.get("TresPerNode"))
        jobs.append(JobDetail(
            job_id=job_id, name=kv.get("JobName", ""),
            user=re.sub(r"\(\d+\)$", "", kv.get("UserId", "")),
            state=kv.get("JobState", ""), reason=_null(kv.get("Reason")),
            partition=kv.get("Partition", ""), nodes=expand_hostlist(_null(kv.get("NodeList"))),
            batch_host=_null(kv.get("BatchHost")), num_nodes=_num(kv.get("NumNodes")),
            priority=_num(kv.get("Priority")), time_limit=kv.get("TimeLimit", ""),
            tres_per_node=tres, mig=mig_request(tres),
            job_gres_raw=job_gres_raw, job_gres=parse_node_gres(job_gres_raw),
            node_gres={n: g for n, g in node_gres.items() if g},
            fields=kv,
        ))
    return jobs


#: ``squeue -O`` fields for one job's record (SlurmClient.job_detail), and the ``scontrol show job`` key each
#: stands in for in JobDetail.fields. None is text the job's user writes: Slurm prints the name, comment, paths
#: and mail user verbatim, newlines included, and one such newline forged a whole ``TresPerNode=`` line in
#: ``scontrol show job`` (seen on Slurm 22.05: ``sbatch -J $'a\n   TresPerNode=gres:mig:7g:1'``). Nor is
#: ``Reason``: squeue prints the job's state_desc there when Slurm set one, free text (the burst-buffer plugins
#: put their script's answer about the job's own #BB/#DW lines in it), and no caller reads it.
JOB_DETAIL_FIELDS: tuple[tuple[str, str], ...] = (
    ("JobID", "JobId"), ("ArrayJobID", "ArrayJobId"), ("ArrayTaskID", "ArrayTaskId"), ("State", "JobState"),
    ("Partition", "Partition"), ("NodeList", "NodeList"), ("BatchHost", "BatchHost"),
    ("NumNodes", "NumNodes"), ("PriorityLong", "Priority"), ("TimeLimit", "TimeLimit"),
    ("tres-per-node", "TresPerNode"), ("SubmitTime", "SubmitTime"), ("StartTime", "StartTime"),
    ("EndTime", "EndTime"), ("exit_code", "ExitCode"), ("UserName", "UserId"), ("RestartCnt", "Restarts"),
)

#: The ``squeue -O`` argument for JOB_DETAIL_FIELDS: each field ends in "|" (none of their values holds one).
JOB_DETAIL_FORMAT = ",".join(f"{name}:|" for name, _ in JOB_DETAIL_FIELDS)


def parse_job_detail(text: str, job_id: int | str) -> JobDetail | None:
    """Job ``job_id`` (``"42"``, or an array task ``"40_2"``) from ``squeue -h --states=all -j ID -O
    JOB_DETAIL_FORMAT`` output; None when it is not there. A line with another number of fields is no record.

    squeue lists every task of an array for the array's id, so the record is picked by its own id. Its fields
    are put under scontrol show job's keys (ExitCode as ``exit:signal``; "N/A" left out) for the callers that
    read those; there is no job name (the user's text) nor reason (free text), see JOB_DETAIL_FIELDS."""
    want = str(job_id).strip()
    for line in text.splitlines():
        values = line.split("|")
        if len(values) != len(JOB_DETAIL_FIELDS) + 1 or values[-1].strip():
            continue
        kv = {key: v.strip() for (_, key), v in zip(JOB_DETAIL_FIELDS, values)}
        kv = {k: v for k, v in kv.items() if v and v not in ("N/A", "n/a", "(null)")}
        array = f"{kv.get('ArrayJobId', '')}_{kv.get('ArrayTaskId', '')}"
        if want not in (kv.get("JobId"), array):
            continue
        if "ArrayTaskId" not in kv:
            kv.pop("ArrayJobId", None)  # squeue says the job's own id there; scontrol says nothing
        status = _num(kv.get("ExitCode"))
        if status is not None:
            kv["ExitCode"] = format_exit_status(status)
        job = _num(kv.get("JobId"))
        if job is None:
            continue
        tres = kv.get("TresPerNode", "")
        return JobDetail(
            job_id=job, user=kv.get("UserId", ""), state=kv.get("JobState", "").rstrip("+"),
            partition=kv.get("Partition", ""),
            nodes=expand_hostlist(kv.get("NodeList")), batch_host=kv.get("BatchHost", ""),
            num_nodes=_num(kv.get("NumNodes")), priority=_num(kv.get("Priority")),
            time_limit=kv.get("TimeLimit", ""), tres_per_node=tres, mig=mig_request(tres), fields=kv,
        )
    return None


def parse_scontrol_kv(text: str) -> dict[str, str]:
    """Top-level ``Key=Value`` fields of the first record in scontrol output (first occurrence wins).

    The ``-d`` per-node detail groups (``Nodes=.. CPU_IDs=.. GRES=..``) are left
    out; use :func:`parse_scontrol_jobs` for them.
    """
    jobs = parse_scontrol_jobs(text)
    if jobs:
        return dict(jobs[0].fields)
    return _first_values(text)


@dataclass(frozen=True)
class SlurmReservation:
    """One advanced reservation from ``scontrol show reservation``."""

    name: str
    start: float  # epoch seconds (scontrol prints local time)
    end: float
    nodes: frozenset[str]
    flags: frozenset[str] = frozenset()  # MAINT, FLEX, MAGNETIC, ...
    active: bool = False  # State=ACTIVE: it has started
    cpus: int | None = None  # TRES=cpu=N: the CPUs it holds (below its nodes' total: only some cores)


def local_epoch(text: str, *, earliest: bool = False, latest: bool = False,
                not_after: float | None = None) -> float | None:
    """Epoch seconds from scontrol's local ``2026-11-22T13:50:38``; None for anything else.

    A local time the clock shows twice (the hour it goes back) names two instants an hour apart, and
    mktime picks either, depending on its previous call (glibc). ``earliest``: the first of them, for a
    caller that must not take a time for later than it may have been; ``latest``: the last, for one that
    must not take it for earlier. ``not_after``: the last of them not after that instant, else the first,
    for a time that has passed and was moments ago (a job's submission or end that no tick saw yet)."""
    try:
        st = time.strptime(text, "%Y-%m-%dT%H:%M:%S")
        if earliest or latest or not_after is not None:
            # Each reading (standard time, summer time) that the clock shows as this very wall time.
            readings = sorted({t for t in (time.mktime(st[:8] + (dst,)) for dst in (0, 1))
                               if tuple(time.localtime(t))[:6] == tuple(st)[:6]})
            if readings:
                if not_after is not None:
                    past = [t for t in readings if t <= not_after]
                    return past[-1] if past else readings[0]
                return readings[0] if earliest else readings[-1]
        return time.mktime(st)
    except (ValueError, OverflowError):
        return None


def parse_reservations(text: str) -> list[SlurmReservation]:
    """Reservations from ``scontrol [-o] show reservation`` text ("No reservations in the system": []).

    A record whose times cannot be read is left out: it restricts nothing rather than everything. A time the
    clock shows twice (the hour it goes back) is read so that the reservation is never shorter than it may be:
    its start as the earlier instant, its end as the later (mktime's guess could end a reservation an hour before
    Slurm does, or start it an hour after, and a job was then placed on a node Slurm keeps it off)."""
    out = []
    for chunk in _records(text, "ReservationName"):
        kv = _first_values(chunk)
        start = local_epoch(kv.get("StartTime", ""), earliest=True)
        end = local_epoch(kv.get("EndTime", ""), latest=True)
        if start is None or end is None:
            continue
        out.append(SlurmReservation(
            name=kv.get("ReservationName", ""), start=start, end=end,
            nodes=frozenset(expand_hostlist(_null(kv.get("Nodes")))),
            flags=frozenset(f.strip().upper() for f in _null(kv.get("Flags")).split(",") if f.strip()),
            active=kv.get("State", "").upper() == "ACTIVE",
            cpus=_num(dict(t.split("=", 1) for t in _null(kv.get("TRES")).split(",") if "=" in t).get("cpu")),
        ))
    return out


def parse_mig_request(fields: dict[str, str]) -> tuple[str, int] | None:
    """``(type, count per node)`` of a job's first mig item, from scontrol fields or squeue JSON.

    Reads ``TresPerNode`` (scontrol) or ``tres_per_node`` (JSON); None when the
    job asks for no typed mig instance.
    """
    tres = fields.get("TresPerNode") or fields.get("tres_per_node") or fields.get("gres") or ""
    req = mig_request(_null(tres))
    if not req:
        return None
    gtype, count = next(iter(req.items()))
    return gtype, count
