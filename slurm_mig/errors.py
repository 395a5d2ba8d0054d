"""The project's typed errors.

Every error a user or admin can meet is a SlurmMigError subclass with a message
that says what was wrong and what was expected; the CLI prints it without a
traceback.
"""

from __future__ import annotations


class SlurmMigError(Exception):
    """Base of every error slurm-mig raises on purpose."""

    exit_code = 1


class ConfigError(SlurmMigError):
    """The configuration file is missing, unreadable or has a bad key/value."""

    exit_code = 2


class GeometryError(SlurmMigError):
    """A MIG profile, placement or layout is unknown or impossible."""

    exit_code = 2


class InvalidLayout(GeometryError):
    """A layout breaks a MIG rule (overlap, compute-slice limit, max count, placement)."""


class TransitionBlocked(SlurmMigError):
    """Reaching a target layout would destroy an instance that is in use."""

    exit_code = 3

    def __init__(self, message: str, blocking: tuple = ()):  # blocking: the busy Slots
        super().__init__(message)
        self.blocking = blocking


class BindingsUnreadable(SlurmMigError):
    """A node's binding records cannot be read (an unreadable folder, a damaged or foreign record).

    A tool that changes MIG layouts outside the hooks refuses then: it cannot tell which instances
    jobs hold, and guessing "none" could destroy one a job is about to use.
    """


class SlurmCommandError(SlurmMigError):
    """A Slurm command that had to succeed failed (non-zero exit, timeout or missing binary).

    ``argv``, ``returncode``, ``stdout`` and ``stderr`` keep what the command did, so
    callers can show Slurm's own message (a job_submit.lua rejection is in ``stderr``).
    """

    def __init__(self, message: str, *, argv: tuple = (), returncode: int | None = None,
                 stdout: str = "", stderr: str = ""):
        super().__init__(message)
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr


class AlreadyRunning(SlurmMigError):
    """Another process holds what this one needs alone (a controller on the same state database)."""

    exit_code = 75  # EX_TEMPFAIL: try again once the other has stopped


class SlurmUnavailable(SlurmMigError):
    """Slurm could not be asked what the controller needs to answer (a query failed or timed out).

    The node's request is answered 503, as for a busy database: the node takes its controller-down
    path, which asks Slurm from the node, rather than acting on a guess.
    """

    exit_code = 75  # EX_TEMPFAIL: try again later


class StoreError(SlurmMigError):
    """The state database cannot be opened, read or written (bad file, unsafe permissions, disk full, I/O error).

    A store operation that raises this has been rolled back: nothing of it was written.
    """


class StoreBusy(StoreError):
    """The state database stayed locked by another writer for longer than the busy timeout."""

    exit_code = 75  # EX_TEMPFAIL: try again later


class BindingConflict(StoreError):
    """A MIG instance is already bound to another live job (or the job is already bound elsewhere).

    ``conflicts`` lists ``(node, gpu, start, other_job_id)`` for each instance in the way.
    """

    exit_code = 3

    def __init__(self, message: str, conflicts: tuple = ()):
        super().__init__(message)
        self.conflicts = tuple(conflicts)
