"""The reconfiguration journal: each GPU re-carving, written before it is done (table reconfig_journal)."""

from __future__ import annotations

from typing import Any, Iterable

from slurm_mig.errors import StoreError
from slurm_mig.mig.layout import Layout
from slurm_mig.store.models import JournalEntry, as_step, dumps
from slurm_mig.store.rows import _now, row_journal
from slurm_mig.store.schema import JOURNAL_OPEN_STATES


class JournalMixin:
    """Store methods on the reconfiguration journal (table reconfig_journal)."""

    # -- reconfiguration journal -------------------------------------------------
    def journal_begin(self, node: str, gpu: int, from_layout: Layout | str, to_layout: Layout | str,
                      steps: Iterable[Any], *, decision_id: int | None = None, started: bool = True,
                      now: float | None = None) -> int:
        """Write the intent of a reconfiguration before touching the GPU; returns the entry id.

        ``steps``: transitions.Step objects (or dicts {action, profile, start}), in order.
        The entry is ``in_progress`` (or ``planned`` with ``started=False``) until journal_finish().
        """
        t = _now(now)
        step_rows = [as_step(s) for s in steps]
        with self.transaction():
            cur = self._x(
                "INSERT INTO reconfig_journal (node, gpu, from_layout, to_layout, steps, state, decision_id, "
                "created_at, started_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (node, int(gpu), str(from_layout), str(to_layout), dumps([s.to_json() for s in step_rows]),
                 "in_progress" if started else "planned", decision_id, t, t if started else None, t),
            )
            return int(cur.lastrowid)

    def journal_entry(self, entry_id: int) -> JournalEntry:
        with self.snapshot():
            rows = self._q("SELECT * FROM reconfig_journal WHERE id = ?", (int(entry_id),))
        if not rows:
            raise StoreError(f"no reconfiguration journal entry {entry_id}")
        return row_journal(rows[0])

    def journal_step(self, entry_id: int, step: int | None = None, *, ok: bool = True, error: str | None = None,
                     now: float | None = None) -> JournalEntry:
        """Record that step number ``step`` (default: the next one) finished (``ok``) or failed.

        A successful step advances ``progress``; a planned entry becomes in_progress.
        """
        t = _now(now)
        with self.transaction():
            entry = self.journal_entry(entry_id)
            if entry.state not in JOURNAL_OPEN_STATES:
                raise StoreError(f"journal entry {entry_id} is already {entry.state}")
            index = entry.progress if step is None else int(step)
            if index != entry.progress or index >= len(entry.steps):
                raise StoreError(f"journal entry {entry_id}: step {index} is not the next step "
                                 f"(progress {entry.progress} of {len(entry.steps)})")
            log_item = {"step": index, "action": entry.steps[index].action, "slot": str(entry.steps[index].slot),
                        "ok": bool(ok), "error": error, "at": t}
            self._x(
                "UPDATE reconfig_journal SET progress = ?, step_log = ?, state = 'in_progress', "
                "started_at = COALESCE(started_at, ?), updated_at = ?, error = COALESCE(?, error) WHERE id = ?",
                (entry.progress + (1 if ok else 0), dumps([*entry.step_log, log_item]), t, t, error, int(entry_id)),
            )
            return self.journal_entry(entry_id)

    def journal_finish(self, entry_id: int, state: str = "done", *, outcome: str | None = None,
                       error: str | None = None, now: float | None = None) -> JournalEntry:
        """Close a journal entry as done, failed or abandoned."""
        if state not in ("done", "failed", "abandoned"):
            raise ValueError(f"journal entries finish as done, failed or abandoned, not {state!r}")
        t = _now(now)
        with self.transaction():
            entry = self.journal_entry(entry_id)
            if entry.state not in JOURNAL_OPEN_STATES:
                raise StoreError(f"journal entry {entry_id} is already {entry.state}")
            self._x("UPDATE reconfig_journal SET state = ?, outcome = ?, error = COALESCE(?, error), updated_at = ?, "
                    "finished_at = ? WHERE id = ?", (state, outcome, error, t, t, int(entry_id)))
            return self.journal_entry(entry_id)

    def journal_started(self, entry_id: int, *, now: float | None = None) -> None:
        """Mark an open entry as taken up by a node (``in_progress``); its start time is kept if it had one."""
        with self.transaction():
            self._x("UPDATE reconfig_journal SET state = 'in_progress', started_at = COALESCE(started_at, ?) "
                    "WHERE id = ? AND state IN ('planned', 'in_progress')", (_now(now), int(entry_id)))

    def open_journal_entries(self, node: str | None = None) -> list[JournalEntry]:
        """Entries still planned or in progress (after a crash: what to resume or undo), oldest first."""
        sql, params = "SELECT * FROM reconfig_journal WHERE state IN ('planned', 'in_progress')", []
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        with self.snapshot():
            return [row_journal(r) for r in self._q(sql + " ORDER BY id", params)]

    def journal_entries(self, *, limit: int = 50) -> list[JournalEntry]:
        """The most recent journal entries, newest first."""
        with self.snapshot():
            return [row_journal(r) for r in self._q("SELECT * FROM reconfig_journal ORDER BY id DESC LIMIT ?",
                                                     (int(limit),))]
