"""Which job holds which MIG instance (table bindings)."""

from __future__ import annotations

import sqlite3
from typing import Any, Iterable

from slurm_mig.errors import BindingConflict, SlurmMigError, StoreError
from slurm_mig.mig.profiles import GpuModel
from slurm_mig.store.models import BoundInstance, as_bound_instance, dumps, known_model, readable_model
from slurm_mig.store.rows import _now
from slurm_mig.store.schema import TERMINAL_STATES


class BindingsMixin:
    """Store methods on the jobs' bindings to MIG instances (table bindings)."""

    # -- bindings --------------------------------------------------------------
    def _gpu_model(self, node: str, gpu: int) -> GpuModel | None:
        rows = self._q("SELECT model FROM gpus WHERE node = ? AND gpu = ?", (node, gpu))
        if not rows or known_model(rows[0]["model"]) is None:
            return None  # (None for a model not in our tables too)
        # and for one whose instances its table does not allow (a newer node's profile or placement)
        return readable_model(rows[0]["model"], self._q("SELECT profile, start FROM instances "
                                                        "WHERE node = ? AND gpu = ?", (node, gpu)))

    def bind(self, job_id: str, node: str, instances: Iterable[Any], *, now: float | None = None
             ) -> tuple[BoundInstance, ...]:
        """Bind ``job_id`` to MIG instances on ``node``; returns what was bound (with UUIDs where known).

        ``instances``: ``(gpu, Slot)`` pairs (an Assignment's ``instances``), BoundInstances or dicts.
        Raises BindingConflict if any instance (or an overlapping one) is bound to another live job, or
        the job is already bound to different instances; binding the same instances again is a no-op.
        """
        job_id = str(job_id)
        items = [as_bound_instance(i) for i in instances]
        if not items:
            raise ValueError(f"bind job {job_id}: no instances given")
        t = _now(now)
        with self.transaction():
            job = self._q("SELECT state FROM jobs WHERE job_id = ?", (job_id,))
            if not job:
                raise StoreError(f"cannot bind unknown job {job_id}")
            if job[0]["state"] in TERMINAL_STATES:
                raise StoreError(f"cannot bind job {job_id}: it already ended ({job[0]['state']})")
            resolved: list[BoundInstance] = []
            for b in items:
                model = self._gpu_model(node, b.gpu)
                profile = model.profile(b.profile).name if model is not None else b.profile
                uuid = b.uuid
                if uuid is None:
                    obs = self._q("SELECT uuid FROM instances WHERE node = ? AND gpu = ? AND start = ? AND profile = ?",
                                  (node, b.gpu, b.start, profile))
                    uuid = obs[0]["uuid"] if obs else None
                resolved.append(BoundInstance(b.gpu, profile, b.start, uuid))
            keys = [(b.gpu, b.start) for b in resolved]
            if len(set(keys)) != len(keys):
                raise ValueError(f"bind job {job_id}: the same instance is listed twice")
            live = self._q("SELECT * FROM bindings WHERE job_id = ? AND released_at IS NULL", (job_id,))
            if live:
                current = {(r["node"], r["gpu"], r["start"], r["profile"]) for r in live}
                if current == {(node, b.gpu, b.start, b.profile) for b in resolved}:
                    return tuple(BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"])
                                 for r in sorted(live, key=lambda r: (r["gpu"], r["start"])))
                raise BindingConflict(
                    f"job {job_id} is already bound to "
                    + ", ".join(f"{r['node']}/{r['gpu']}/{r['profile']}@{r['start']}" for r in live),
                    tuple((r["node"], r["gpu"], r["start"], job_id) for r in live),
                )
            conflicts = []
            for b in resolved:
                model = self._gpu_model(node, b.gpu)
                others = self._q("SELECT job_id, gpu, start, profile, uuid FROM bindings "
                                 "WHERE node = ? AND gpu = ? AND released_at IS NULL", (node, b.gpu))
                if b.uuid is not None:
                    others += self._q("SELECT job_id, gpu, start, profile, uuid FROM bindings "
                                      "WHERE uuid = ? AND released_at IS NULL", (b.uuid,))
                for o in others:
                    same = o["start"] == b.start or (b.uuid is not None and o["uuid"] == b.uuid)
                    overlap = False
                    if model is not None and not same:
                        try:
                            overlap = bool(model.profile(o["profile"]).mask(o["start"])
                                           & model.profile(b.profile).mask(b.start))
                        except SlurmMigError:
                            overlap = False
                    if same or overlap:
                        conflicts.append((node, b.gpu, b.start, o["job_id"]))
            if conflicts:
                raise BindingConflict(
                    f"cannot bind job {job_id} on {node}: "
                    + "; ".join(f"GPU {g} slice {s} is held by live job {other}" for _, g, s, other in conflicts),
                    tuple(dict.fromkeys(conflicts)),
                )
            try:
                for b in resolved:
                    self._x(
                        "INSERT INTO bindings (job_id, node, gpu, start, profile, uuid, bound_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (job_id, node, b.gpu, b.start, b.profile, b.uuid, t),
                    )
            except sqlite3.IntegrityError as exc:  # the partial unique indexes: a second line of defence
                raise BindingConflict(f"cannot bind job {job_id} on {node}: an instance is already bound ({exc})") from exc
            self._x("UPDATE jobs SET node = ?, instances = ?, updated_at = ? WHERE job_id = ?",
                    (node, dumps([b.to_json() for b in resolved]), t, job_id))
        return tuple(resolved)

    def release(self, job_id: str, *, node: str | None = None, starts: Iterable[tuple[int, int]] | None = None,
                now: float | None = None) -> int:
        """Release the live bindings of ``job_id`` (only those on ``node``, and only the ``(gpu, start)``
        instances in ``starts``, when given); returns how many were released (0 if none)."""
        sql, params = "UPDATE bindings SET released_at = ? WHERE job_id = ? AND released_at IS NULL", [_now(now),
                                                                                                     str(job_id)]
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        if starts is not None:
            pairs = sorted({(int(g), int(st)) for g, st in starts})
            if not pairs:
                return 0
            sql += " AND (" + " OR ".join("(gpu = ? AND start = ?)" for _ in pairs) + ")"
            params += [v for pair in pairs for v in pair]
        with self.transaction():
            return self._x(sql, params).rowcount

    def set_binding_uuid(self, job_id: str, node: str, gpu: int, start: int, uuid: str | None) -> None:
        """Record the MIG UUID ``node`` reports for ``job_id``'s live binding at ``start`` on GPU ``gpu`` (None: the
        node gave none, and none is recorded); nothing when the job holds no such live binding."""
        with self.transaction():
            self._x("UPDATE bindings SET uuid = ? WHERE job_id = ? AND node = ? AND gpu = ? AND start = ? "
                    "AND released_at IS NULL", (uuid, str(job_id), node, int(gpu), int(start)))

    def bound_instances(self, job_id: str) -> tuple[BoundInstance, ...]:
        """The instances ``job_id`` holds now (live bindings), by GPU then start."""
        with self.snapshot():
            rows = self._q("SELECT gpu, profile, start, uuid FROM bindings WHERE job_id = ? AND released_at IS NULL "
                           "ORDER BY gpu, start", (str(job_id),))
        return tuple(BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"]) for r in rows)

    def bound_nodes(self, job_id: str) -> set[str]:
        """The nodes on which ``job_id`` holds live bindings."""
        with self.snapshot():
            rows = self._q("SELECT DISTINCT node FROM bindings WHERE job_id = ? AND released_at IS NULL",
                           (str(job_id),))
        return {r["node"] for r in rows}

    def live_bindings(self, node: str | None = None) -> list[tuple[str, str, BoundInstance]]:
        """``(job_id, node, instance)`` for every live binding (optionally on one node)."""
        sql, params = "SELECT * FROM bindings WHERE released_at IS NULL", []
        if node is not None:
            sql += " AND node = ?"
            params.append(node)
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu, start", params)
        return [(r["job_id"], r["node"], BoundInstance(r["gpu"], r["profile"], r["start"], r["uuid"])) for r in rows]

    def job_on_instance(self, node: str, gpu: int, start: int) -> str | None:
        """The live job bound to the instance at ``start`` on ``node``/``gpu``, if any."""
        with self.snapshot():
            rows = self._q("SELECT job_id FROM bindings WHERE node = ? AND gpu = ? AND start = ? AND released_at IS NULL",
                           (node, int(gpu), int(start)))
        return rows[0]["job_id"] if rows else None
