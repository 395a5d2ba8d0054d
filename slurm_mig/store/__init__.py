"""The controller's state store (SQLite via sqlite-utils): schema, migrations and typed access.

    from slurm_mig.store import open_store
    store = open_store("/var/lib/slurm-mig/state.db")   # or ":memory:"
    with store.transaction():                           # one controller tick
        state = store.cluster_state()
        ...
"""

from slurm_mig.errors import BindingConflict, StoreBusy, StoreError
from slurm_mig.store.db import (
    DEFAULT_BUSY_TIMEOUT_S,
    MEMORY,
    Store,
    open_store,
    open_store_from_config,
    prepare_db_file,
)
from slurm_mig.store.models import (
    BoundInstance,
    DecisionRecord,
    DesiredLayout,
    Event,
    Job,
    JournalEntry,
    JournalStep,
    Node,
    ObservedGpu,
    ObservedInstance,
    Outcome,
    decision_to_json,
    state_to_json,
)
from slurm_mig.store.schema import (
    JOB_STATES,
    JOURNAL_STATES,
    LATEST_VERSION,
    MIGRATIONS,
    NODE_STATES,
    RUNNING_STATES,
    TERMINAL_STATES,
    migrate,
    schema_version,
)

__all__ = [
    "BindingConflict", "StoreBusy", "StoreError",
    "DEFAULT_BUSY_TIMEOUT_S", "MEMORY", "Store", "open_store", "open_store_from_config", "prepare_db_file",
    "BoundInstance", "DecisionRecord", "DesiredLayout", "Event", "Job", "JournalEntry", "JournalStep", "Node",
    "ObservedGpu", "ObservedInstance", "Outcome", "decision_to_json", "state_to_json",
    "JOB_STATES", "JOURNAL_STATES", "LATEST_VERSION", "MIGRATIONS", "NODE_STATES", "RUNNING_STATES",
    "TERMINAL_STATES", "migrate", "schema_version",
]
