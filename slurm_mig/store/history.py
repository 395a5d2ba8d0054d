"""The history tables: the policy's decisions, events, the node messages handled, and prune, which bounds them."""

from __future__ import annotations

from typing import Any

from slurm_mig.store.models import DecisionRecord, Event, decision_to_json, dumps, loads, state_to_json
from slurm_mig.store.rows import _dumps_finite, _now, _utf8_len


#: Store.prune deletes old decisions this many bytes of them per transaction, and at most so many per call.
PRUNE_STEP_BYTES = 64 * 1024 * 1024
PRUNE_MAX_BYTES = 256 * 1024 * 1024


class HistoryMixin:
    """Store methods on the history tables (decisions, events, node_messages) and their pruning."""

    # -- decisions -------------------------------------------------------------
    def record_decision(self, decision: Any, *, state: Any = None, inputs: Any = None,
                        latency_ms: float | None = None, shadow: bool = False, now: float | None = None) -> int:
        """Store a policy Decision (and the ClusterState it saw) for `explain`, replay and training.

        For a live (non-shadow) decision, each waiting job's reason is copied to its jobs row.
        Returns the decision id.
        """
        t = _now(now)
        if inputs is None:
            inputs = state_to_json(state) if state is not None else {}
        waiting = [[str(j), r] for j, r in decision.waiting]
        texts = (_dumps_finite(inputs), _dumps_finite(decision_to_json(decision)), dumps(waiting))
        size = sum(_utf8_len(x) for x in texts)
        with self.transaction():
            cur = self._x(
                "INSERT INTO decisions (time, policy, version, shadow, inputs, action, reasons, latency_ms) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (t, decision.policy or "", decision.version or "", int(bool(shadow)), *texts, latency_ms),
            )
            self._x("INSERT INTO decision_bytes (id, bytes) VALUES (?, ?)", (cur.lastrowid, size))
            self.decision_bytes_unpruned += size
            if not shadow:
                # One statement run for every job, in this order (a job both waiting and assigned ends with the
                # assignment's reason), as the one statement per job it replaces.
                update = "UPDATE jobs SET reason = ? WHERE job_id = ? AND state = 'PENDING'"
                self._xm(update, [(reason, job_id) for job_id, reason in waiting])
                self._xm(update, [(a.reason, a.job_id) for a in decision.assignments])
            return int(cur.lastrowid)

    def recent_decisions(self, n: int = 20, *, shadow: bool | None = None) -> list[DecisionRecord]:
        """The last ``n`` decisions, newest first (only live or only shadow ones if ``shadow`` is set)."""
        sql, params = "SELECT * FROM decisions", []
        if shadow is not None:
            sql += " WHERE shadow = ?"
            params.append(int(shadow))
        with self.snapshot():
            rows = self._q(sql + " ORDER BY id DESC LIMIT ?", (*params, int(n)))
        return [DecisionRecord(r["id"], r["time"], r["policy"], r["version"], bool(r["shadow"]), loads(r["inputs"]),
                               loads(r["action"], {}), loads(r["reasons"], []), r["latency_ms"]) for r in rows]

    # -- events ----------------------------------------------------------------
    def prune(self, *, keep_decisions: int = 50_000, keep_decisions_bytes: int | None = None,
              keep_events: int = 200_000, keep_journal_days: float = 30.0,
              now: float | None = None) -> dict[str, int]:
        """Bound the history tables: the newest decisions/events by count, finished journal entries by age.

        Decisions are also bound by size when ``keep_decisions_bytes`` is given: the oldest go until the
        newest ones' inputs, action and reasons (as stored, table decision_bytes) fit in it; the newest one
        is always kept, whatever its size. The sizes are read from decision_bytes, never from the JSON.
        Deleting a decision reads its pages (SQLite frees them one by one, some 7 ms a MB), so they go
        oldest first, PRUNE_STEP_BYTES per transaction (node requests get the lock in between), and at most
        PRUNE_MAX_BYTES per call; what is left to go is then ``decision_bytes_unpruned``, and the controller
        prunes again next tick when that is a tenth of its budget (the first prune of an upgraded database
        that has grown to tens of GB).
        The record of handled node messages (node_messages) is kept as long as finished journal entries: a
        node re-sends a message within minutes, or when it is back from a failure.
        Jobs, bindings and outcomes are never pruned here (outcomes are training data).
        """
        cutoff = _now(now) - keep_journal_days * 86400
        with self.snapshot():
            last = self._x("SELECT MAX(id) FROM decisions").fetchone()[0] or 0
            upto = last - int(keep_decisions)  # decisions with an id up to this go
            if keep_decisions_bytes is not None:
                # SQLite's integers are 64-bit: a budget past them keeps everything, as one just below does.
                budget = min(max(int(keep_decisions_bytes), 0), 2 ** 62)
                row = self._x(
                    "SELECT MAX(id) FROM (SELECT id, SUM(bytes) OVER (ORDER BY id DESC) AS newer FROM decision_bytes) "
                    "WHERE newer > ?", (budget,)).fetchone()
                if row[0] is not None:
                    upto = max(upto, min(int(row[0]), last - 1))  # the newest one stays
            going = self._x("SELECT id, bytes FROM decision_bytes WHERE id <= ? ORDER BY id", (upto,)).fetchall()
        # The steps: the last id each deletes. The final one takes any decision without a size, too.
        ends, step, total, left = [], 0, 0, 0
        for i, (did, size) in enumerate(going):
            if total and total + size > PRUNE_MAX_BYTES:
                left = sum(b for _, b in going[i:])
                break
            if step and step + size > PRUNE_STEP_BYTES:
                ends.append(going[i - 1][0])
                step = 0
            step += size
            total += size
        else:
            ends.append(upto)
        if left:
            ends.append(going[i - 1][0])
        d = 0
        for end_id in ends:
            with self.transaction():
                d += self._x("DELETE FROM decisions WHERE id <= ?", (end_id,)).rowcount
                self._x("DELETE FROM decision_bytes WHERE id <= ?", (end_id,))
        self.decision_bytes_unpruned = left
        with self.transaction():
            e = self._x("DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ?", (int(keep_events),)).rowcount
            j = self._x("DELETE FROM reconfig_journal WHERE finished_at IS NOT NULL AND finished_at < ?",
                        (cutoff,)).rowcount
            m = self._x("DELETE FROM node_messages WHERE handled_at < ?", (cutoff,)).rowcount
        return {"decisions": d, "events": e, "journal": j, "messages": m}

    def message_answer(self, node: str, route: str, message_id: str) -> dict | None:
        """The answer the node message ``message_id`` from ``node`` on ``route`` was given when it was
        handled (see record_message); None if it was not (or that was longer ago than prune keeps). Ask
        inside the transaction that would handle it, so that a second delivery cannot slip in between."""
        with self.snapshot():
            rows = self._q("SELECT answer FROM node_messages WHERE node = ? AND route = ? AND message_id = ?",
                           (node, route, str(message_id)))
        return loads(rows[0]["answer"], {}) if rows else None

    def record_message(self, node: str, route: str, message_id: str, answer: dict, *,
                       now: float | None = None) -> None:
        """Note that the node message ``message_id`` was handled and answered ``answer``, in the
        transaction of its effects: a later delivery of it is answered the same and changes nothing."""
        with self.transaction():
            self._x("INSERT INTO node_messages (node, route, message_id, answer, handled_at) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT(node, route, message_id) DO NOTHING",
                    (node, route, str(message_id), dumps(answer), _now(now)))

    def add_event(self, kind: str, message: str, details: dict | None = None, *, node: str | None = None,
                  job_id: str | None = None, now: float | None = None) -> int:
        with self.transaction():
            cur = self._x("INSERT INTO events (time, kind, message, node, job_id, details) VALUES (?, ?, ?, ?, ?, ?)",
                          (_now(now), kind, message, node, None if job_id is None else str(job_id),
                           dumps(details or {})))
            return int(cur.lastrowid)

    def recent_events(self, n: int = 50, *, kind: str | None = None, node: str | None = None,
                      job_id: str | None = None) -> list[Event]:
        """The last ``n`` events, newest first, optionally filtered."""
        where, params = [], []
        for col, val in (("kind", kind), ("node", node), ("job_id", job_id)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(str(val))
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        with self.snapshot():
            rows = self._q(sql, (*params, int(n)))
        return [Event(r["id"], r["time"], r["kind"], r["message"], r["node"], r["job_id"], loads(r["details"], {}))
                for r in rows]
