"""The state database schema as numbered migrations.

Each migration is a small, append-only step: ``(version, name, apply)`` where
``apply`` is SQL text or a function taking the ``sqlite_utils.Database``. Never
edit a migration that has shipped; add the next number instead. ``migrate(db)``
applies whatever is missing, each migration in its own ``BEGIN IMMEDIATE``
transaction, re-reading the version inside it, so two processes opening the same
file at once cannot apply a step twice. It is idempotent: on an up-to-date
database it does nothing. The applied steps are listed in ``schema_migrations``
and the current number is mirrored in ``PRAGMA user_version``.

Conventions: times are Unix seconds (REAL); ``gpu`` is the NVML GPU index on its
node; ``start`` is a MIG placement start in memory slices; ``profile`` is a full
profile name ("3g.40gb"); JSON columns hold text written by ``json.dumps``.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Callable, Union

import sqlite_utils

from slurm_mig.errors import StoreError

Migration = tuple[int, str, Union[str, Callable[[sqlite_utils.Database], None]]]

# Slurm job states (squeue's long names) plus REQUEUED. A job is "live" (may
# hold bindings) in LIVE_STATES and finished for good in TERMINAL_STATES.
JOB_STATES = (
    "PENDING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED",
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
)
RUNNING_STATES = ("RUNNING", "SUSPENDED", "COMPLETING")
TERMINAL_STATES = (
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
    "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
)
NODE_STATES = ("up", "down", "drain", "unknown")
JOURNAL_STATES = ("planned", "in_progress", "done", "failed", "abandoned")
JOURNAL_OPEN_STATES = ("planned", "in_progress")


_V1_BASE = """
CREATE TABLE nodes (
    name          TEXT PRIMARY KEY,
    state         TEXT NOT NULL DEFAULT 'unknown' CHECK (state IN ('up', 'down', 'drain', 'unknown')),
    last_seen     REAL,
    health        TEXT NOT NULL DEFAULT 'unknown',   -- 'ok' or a short problem description
    health_detail TEXT,                              -- JSON
    agent_version TEXT
);

CREATE TABLE gpus (
    node          TEXT NOT NULL REFERENCES nodes(name) ON DELETE CASCADE,
    gpu           INTEGER NOT NULL CHECK (gpu >= 0),
    uuid          TEXT,
    name          TEXT,                              -- nvmlDeviceGetName
    model         TEXT,                              -- GpuModel.name, NULL if not a known MIG model
    mig_enabled   INTEGER NOT NULL DEFAULT 0 CHECK (mig_enabled IN (0, 1)),
    last_observed REAL NOT NULL,
    PRIMARY KEY (node, gpu)
);

CREATE TABLE instances (
    node          TEXT NOT NULL,
    gpu           INTEGER NOT NULL,
    profile       TEXT NOT NULL,
    start         INTEGER NOT NULL CHECK (start >= 0),
    uuid          TEXT,
    gi_id         INTEGER,
    ci_id         INTEGER,
    in_use        INTEGER NOT NULL DEFAULT 0 CHECK (in_use IN (0, 1)),
    observed_at   REAL NOT NULL,
    PRIMARY KEY (node, gpu, start),
    FOREIGN KEY (node, gpu) REFERENCES gpus(node, gpu) ON DELETE CASCADE
);

CREATE TABLE desired_layouts (
    node          TEXT NOT NULL,
    gpu           INTEGER NOT NULL,
    layout        TEXT NOT NULL,                     -- parse_layout() spec, e.g. '3g@0,2g@4,1g@6'
    policy        TEXT NOT NULL,
    decided_at    REAL NOT NULL,
    reason        TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (node, gpu)
);

CREATE TABLE jobs (
    job_id        TEXT PRIMARY KEY,                  -- Slurm job id ('1234' or '1234_5')
    user          TEXT NOT NULL DEFAULT '',
    name          TEXT NOT NULL DEFAULT '',
    partition     TEXT NOT NULL DEFAULT '',
    profile       TEXT NOT NULL,                     -- as requested: kind ('3g') or full name
    count         INTEGER NOT NULL DEFAULT 1 CHECK (count >= 1),
    time_limit_s  REAL,
    state         TEXT NOT NULL DEFAULT 'PENDING',
    reason        TEXT NOT NULL DEFAULT '',          -- why it waits / why it ended, for `explain`
    submit_time   REAL NOT NULL,
    start_time    REAL,
    end_time      REAL,
    node          TEXT,
    instances     TEXT NOT NULL DEFAULT '[]',        -- JSON [{gpu, profile, start, uuid}]
    priority_order INTEGER,                          -- position in Slurm's queue, lower runs first
    exit_code     INTEGER,
    updated_at    REAL NOT NULL
);

CREATE TABLE bindings (
    id            INTEGER PRIMARY KEY,
    job_id        TEXT NOT NULL REFERENCES jobs(job_id) ON DELETE CASCADE,
    node          TEXT NOT NULL,
    gpu           INTEGER NOT NULL,
    start         INTEGER NOT NULL,
    profile       TEXT NOT NULL,
    uuid          TEXT,
    bound_at      REAL NOT NULL,
    released_at   REAL
);
-- One MIG instance can belong to one live job only.
CREATE UNIQUE INDEX bindings_live_slot ON bindings(node, gpu, start) WHERE released_at IS NULL;
CREATE UNIQUE INDEX bindings_live_uuid ON bindings(uuid) WHERE released_at IS NULL AND uuid IS NOT NULL;
CREATE INDEX bindings_job ON bindings(job_id);

CREATE TABLE decisions (
    id            INTEGER PRIMARY KEY,
    time          REAL NOT NULL,
    policy        TEXT NOT NULL,
    version       TEXT NOT NULL DEFAULT '',
    shadow        INTEGER NOT NULL DEFAULT 0 CHECK (shadow IN (0, 1)),
    inputs        TEXT NOT NULL,                     -- JSON ClusterState
    action        TEXT NOT NULL,                     -- JSON Decision (changes, assignments)
    reasons       TEXT NOT NULL DEFAULT '[]',        -- JSON [[job_id, why it waits], ...]
    latency_ms    REAL
);
CREATE INDEX decisions_time ON decisions(time);

CREATE TABLE reconfig_journal (
    id            INTEGER PRIMARY KEY,
    node          TEXT NOT NULL,
    gpu           INTEGER NOT NULL,
    from_layout   TEXT NOT NULL,
    to_layout     TEXT NOT NULL,
    steps         TEXT NOT NULL,                     -- JSON [{action, profile, start}]
    progress      INTEGER NOT NULL DEFAULT 0,        -- steps completed
    step_log      TEXT NOT NULL DEFAULT '[]',        -- JSON [{step, ok, error, at}]
    state         TEXT NOT NULL DEFAULT 'planned'
                  CHECK (state IN ('planned', 'in_progress', 'done', 'failed', 'abandoned')),
    outcome       TEXT,
    error         TEXT,
    decision_id   INTEGER,
    created_at    REAL NOT NULL,
    started_at    REAL,
    updated_at    REAL NOT NULL,
    finished_at   REAL
);

CREATE TABLE outcomes (
    job_id        TEXT PRIMARY KEY,                  -- recorded exactly once
    profile       TEXT NOT NULL,
    count         INTEGER NOT NULL,
    node          TEXT,
    gpus          TEXT NOT NULL DEFAULT '[]',        -- JSON [gpu index, ...]
    instances     TEXT NOT NULL DEFAULT '[]',        -- JSON [{gpu, profile, start, uuid}]
    user          TEXT NOT NULL DEFAULT '',
    partition     TEXT NOT NULL DEFAULT '',
    time_limit_s  REAL,
    submit_time   REAL,
    start_time    REAL,
    end_time      REAL,
    wait_s        REAL,
    run_s         REAL,
    exit_code     INTEGER,
    derived_exit_code INTEGER,
    state         TEXT NOT NULL,
    recorded_at   REAL NOT NULL
);

CREATE TABLE events (
    id            INTEGER PRIMARY KEY,
    time          REAL NOT NULL,
    kind          TEXT NOT NULL,
    message       TEXT NOT NULL,
    node          TEXT,
    job_id        TEXT,
    details       TEXT NOT NULL DEFAULT '{}'         -- JSON
);
CREATE INDEX events_time ON events(time);
"""

_V2_INDEXES_AND_META = """
-- Hot queries of a controller tick, and a small key/value table for controller state
-- (last tick time, leader lease, ...).
CREATE INDEX jobs_state_order ON jobs(state, priority_order, submit_time);
CREATE INDEX reconfig_journal_open ON reconfig_journal(state) WHERE state IN ('planned', 'in_progress');
CREATE INDEX events_kind_time ON events(kind, time);
CREATE INDEX outcomes_end ON outcomes(end_time);
CREATE TABLE meta (
    key           TEXT PRIMARY KEY,
    value         TEXT NOT NULL,                     -- JSON
    updated_at    REAL NOT NULL
);
"""

_V3_BLOCKED_JOBS = """
-- Why Slurm will not start a pending job now whatever the GPUs (held, a dependency, a begin time, an
-- array at its task limit, a QOS or association limit); NULL: it may start. The policy carves only
-- for jobs that may start.
ALTER TABLE jobs ADD COLUMN blocked TEXT;
"""

_V4_OUTCOME_RUNS = """
-- One outcome per run of a job id, not one per id: Slurm reuses ids (a controller rebuilt with a fresh
-- StateSaveLocation, ids wrapping at MaxJobId, a job requeued after it ended), and the outcome of the
-- id's second run was dropped. A run is the jobs row's ``run``: 1 for its first, one more each time the
-- id runs again after it ended here (Store.restart_job). The Epilog's report carries nothing that tells
-- runs apart, and the jobs row's start_time is no key: it is NULL for a run whose Epilog arrived before
-- a tick saw it running, so two such runs would be one. An outcome takes the run of the jobs row it is
-- recorded from; (job_id, run) is unique, so the same run reported twice (a retried Epilog, a re-sent
-- outbox message, an Epilog arriving after Slurm's own record settled the run) still writes one row.
ALTER TABLE jobs ADD COLUMN run INTEGER NOT NULL DEFAULT 1 CHECK (run >= 1);

CREATE TABLE outcomes_v4 (
    job_id        TEXT NOT NULL,
    run           INTEGER NOT NULL DEFAULT 1 CHECK (run >= 1),  -- the jobs row's run it was recorded from
    profile       TEXT NOT NULL,
    count         INTEGER NOT NULL,
    node          TEXT,
    gpus          TEXT NOT NULL DEFAULT '[]',        -- JSON [gpu index, ...]
    instances     TEXT NOT NULL DEFAULT '[]',        -- JSON [{gpu, profile, start, uuid}]
    user          TEXT NOT NULL DEFAULT '',
    partition     TEXT NOT NULL DEFAULT '',
    time_limit_s  REAL,
    submit_time   REAL,
    start_time    REAL,
    end_time      REAL,
    wait_s        REAL,
    run_s         REAL,
    exit_code     INTEGER,
    derived_exit_code INTEGER,
    state         TEXT NOT NULL,
    recorded_at   REAL NOT NULL,
    PRIMARY KEY (job_id, run)                        -- recorded exactly once per run
);
INSERT INTO outcomes_v4 (job_id, run, profile, count, node, gpus, instances, user, partition, time_limit_s,
                         submit_time, start_time, end_time, wait_s, run_s, exit_code, derived_exit_code, state,
                         recorded_at)
    SELECT job_id, 1, profile, count, node, gpus, instances, user, partition, time_limit_s, submit_time,
           start_time, end_time, wait_s, run_s, exit_code, derived_exit_code, state, recorded_at
    FROM outcomes ORDER BY rowid;
DROP TABLE outcomes;
ALTER TABLE outcomes_v4 RENAME TO outcomes;
CREATE INDEX outcomes_end ON outcomes(end_time);

-- A job already running again when this version came (its id's one outcome is an earlier run's: the job
-- is live, or ended with another start time, which is the run the outcome was taken from) is on run 2.
UPDATE jobs SET run = 2 WHERE EXISTS (
    SELECT 1 FROM outcomes o WHERE o.job_id = jobs.job_id AND (
        jobs.state NOT IN ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'PREEMPTED',
                           'OUT_OF_MEMORY', 'BOOT_FAIL', 'DEADLINE')
        OR o.start_time IS NOT jobs.start_time));
"""

_V5_BLOCKED_GPUS = """
-- Why slurm-mig must not change this GPU's layout or start new jobs on it now, although its MIG mode is
-- on (a MIG mode change waiting for a GPU reset, GPU instances of a profile it does not know); NULL: it
-- may. Its instances and their jobs run on.
ALTER TABLE gpus ADD COLUMN blocked TEXT;
"""

_V6_NODE_MESSAGES = """
-- The node messages handled (/v1/bound, /v1/bind-failed, /v1/epilog, /v1/applied that carry a
-- message_id), and the answer each got. A node sends a message again when it did not get the answer
-- (its client's retry, the outbox at the next hook or health check); such a delivery is answered from
-- here and changes nothing, since by then the job may run again with another binding. Written in the
-- transaction that handled the message; pruned after [controller].keep_journal_days.
CREATE TABLE node_messages (
    node          TEXT NOT NULL,
    route         TEXT NOT NULL,
    message_id    TEXT NOT NULL,                     -- made once per message on the node (hex)
    answer        TEXT NOT NULL,                     -- JSON: what the first delivery was answered
    handled_at    REAL NOT NULL,
    PRIMARY KEY (node, route, message_id)
);
CREATE INDEX node_messages_time ON node_messages(handled_at);
"""

_V7_DECISION_BYTES = """
-- The size of each decision as stored (its inputs, action and reasons JSON, in bytes), for
-- [controller].keep_decisions_mb: Store.prune keeps the newest decisions that fit the budget. A table
-- of its own, not a column of decisions: a decision at a large site is over 1 MB, so a column there
-- lies past the row's overflow pages (SQLite reads them all to reach it) and this step's UPDATE
-- would rewrite every stored decision (the whole history again, in the WAL); here it reads each
-- once. Written with its decision (Store.record_decision), deleted with it (Store.prune).
CREATE TABLE decision_bytes (
    id            INTEGER PRIMARY KEY,               -- decisions.id
    bytes         INTEGER NOT NULL CHECK (bytes >= 0)
);
INSERT INTO decision_bytes (id, bytes)
    SELECT id, length(CAST(inputs AS BLOB)) + length(CAST(action AS BLOB)) + length(CAST(reasons AS BLOB))
    FROM decisions ORDER BY id;
"""

_V8_JOB_UIDS = """
-- The uid of each job's user (squeue --json's user_id), beside its name: a name is not the user's for good
-- (renamed in the directory; squeue prints the uid where the head node's lookup fails, and a name may be all
-- digits), and the rule that another user's job under a stored run's id is another job compared names alone:
-- alice renamed while her job ran took it for another user's, its instances released. NULL: not known (rows
-- written before this version, or by a Prolog that had only squeue's name).
ALTER TABLE jobs ADD COLUMN uid INTEGER;
"""

_V9_JOB_SUSPENSIONS = """
-- Time a running job spent suspended (`scontrol suspend`, gang or suspend preemption), from squeue's
-- suspend_time and pre_sus_time: Slurm does not count it against the time limit (it moves the job's end on
-- resume), so the policy's end estimate (start + limit) and the recorded run time (end - start) were off by it.
-- suspended_s: seconds the run was suspended before its last suspend or resume; suspended_since: when the
-- suspension going on began (NULL: not suspended now). NULL suspended_s: never seen suspended (0). Both
-- cleared when the job waits again (a requeue, the id's next run).
ALTER TABLE jobs ADD COLUMN suspended_s REAL;
ALTER TABLE jobs ADD COLUMN suspended_since REAL;
"""

# guessed is 2 (store/outcomes.py GUESSED_SUSPENDED) for a guess of a run suspended at the end guessed, as
# record_outcome writes it: so are the rows this migration marks whose jobs row notes a suspension going on.
_V10_GUESSED_OUTCOMES = """
-- 1: the outcome is the controller's guess, not Slurm's record of the run nor its Epilog's: a run whose Epilog
-- never came, settled after Slurm had forgotten the job (FAILED, no exit status; controller/runs.py FORGOTTEN).
-- The run's Epilog, arriving later, replaces it, also once the id runs again and the jobs row (whose reason
-- said so) is the next run's. Rows written before this version: those of a current run so settled.
ALTER TABLE outcomes ADD COLUMN guessed INTEGER NOT NULL DEFAULT 0;
UPDATE outcomes SET guessed = (
    SELECT CASE WHEN j.suspended_since IS NOT NULL THEN 2 ELSE 1 END FROM jobs j
    WHERE j.job_id = outcomes.job_id AND j.run = outcomes.run)
WHERE state = 'FAILED' AND exit_code IS NULL AND EXISTS (
    SELECT 1 FROM jobs j WHERE j.job_id = outcomes.job_id AND j.run = outcomes.run AND j.state = 'FAILED'
    AND j.reason = 'ended unseen: neither Slurm''s record nor its Epilog said how');
"""

MIGRATIONS: tuple[Migration, ...] = (
    (1, "base tables", _V1_BASE),
    (2, "indexes for the controller tick; meta table", _V2_INDEXES_AND_META),
    (3, "jobs.blocked: pending jobs Slurm will not start now", _V3_BLOCKED_JOBS),
    (4, "outcomes: one per run of a job id (ids are reused); jobs.run", _V4_OUTCOME_RUNS),
    (5, "gpus.blocked: GPUs slurm-mig must leave as they are", _V5_BLOCKED_GPUS),
    (6, "node_messages: node messages handled, answered once", _V6_NODE_MESSAGES),
    (7, "decision_bytes: each decision's stored size, for [controller].keep_decisions_mb", _V7_DECISION_BYTES),
    (8, "jobs.uid: the uid of each job's user", _V8_JOB_UIDS),
    (9, "jobs.suspended_s, jobs.suspended_since: time a run spent suspended", _V9_JOB_SUSPENSIONS),
    (10, "outcomes.guessed: outcomes the controller guessed, which a late Epilog replaces", _V10_GUESSED_OUTCOMES),
)

LATEST_VERSION = MIGRATIONS[-1][0]


def _ensure_migrations_table(db: sqlite_utils.Database) -> None:
    db.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
    )


def schema_version(db: sqlite_utils.Database) -> int:
    """The highest migration applied to ``db`` (0 for a new, empty database)."""
    if "schema_migrations" not in db.table_names():
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
    return int(row[0] or 0)


def _run_statements(db: sqlite_utils.Database, sql: str) -> None:
    """Run a multi-statement SQL text inside the caller's transaction (no implicit COMMIT)."""
    # sqlite3.complete_statement splits safely on ';' that end statements.
    buf = ""
    for line in sql.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                db.conn.execute(buf)
            buf = ""
    leftover = [line for line in buf.splitlines() if line.strip() and not line.strip().startswith("--")]
    if leftover:
        raise StoreError(f"incomplete SQL statement in a migration: {buf.strip()[:80]!r}")


def migrate(db: sqlite_utils.Database, target: int | None = None) -> list[int]:
    """Bring ``db`` up to ``target`` (default: the latest version); return the versions applied.

    Idempotent and safe against a second process migrating the same file at the
    same moment. Refuses (StoreError) a database written by a newer slurm-mig.
    The connection must not be inside a transaction.
    """
    target = LATEST_VERSION if target is None else target
    known = {v for v, _, _ in MIGRATIONS}
    if target not in known and target != 0:
        raise StoreError(f"unknown schema version {target} (known: {sorted(known)})")
    if db.conn.in_transaction:
        raise StoreError("migrate() must not run inside an open transaction")
    applied: list[int] = []
    current = schema_version(db)
    if current > LATEST_VERSION:
        raise StoreError(
            f"the state database is at schema version {current}, newer than this slurm-mig "
            f"understands ({LATEST_VERSION}); upgrade slurm-mig or use another database"
        )
    for version, name, step in MIGRATIONS:
        if version > target or version <= current:
            continue
        db.conn.execute("BEGIN IMMEDIATE")
        try:
            _ensure_migrations_table(db)
            if schema_version(db) >= version:  # another process got here first
                db.conn.execute("COMMIT")
                continue
            if isinstance(step, str):
                _run_statements(db, step)
            else:
                step(db)
            db.conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                (version, name, time.time()),
            )
            db.conn.execute(f"PRAGMA user_version = {int(version)}")
            db.conn.execute("COMMIT")
        except BaseException:
            if db.conn.in_transaction:
                db.conn.execute("ROLLBACK")
            raise
        applied.append(version)
    return applied
