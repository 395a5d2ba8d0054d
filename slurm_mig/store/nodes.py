"""The nodes and what they report of their GPUs and MIG instances (tables nodes, gpus, instances)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from slurm_mig.mig.layout import Layout, Slot
from slurm_mig.store.models import (
    Node,
    ObservedGpu,
    ObservedInstance,
    as_observed_gpu,
    as_observed_instance,
    dumps,
    known_model,
    readable_model,
    unknown_model_reason,
)
from slurm_mig.store.rows import _check_state, _now, _row_node
from slurm_mig.store.schema import NODE_STATES


class NodesMixin:
    """Store methods on the nodes and their observed GPUs and MIG instances (tables nodes, gpus, instances)."""

    # -- nodes -----------------------------------------------------------------
    def upsert_node(self, name: str, *, state: str | None = None, health: str | None = None,
                    health_detail: dict | None = None, agent_version: str | None = None,
                    last_seen: float | None = None) -> None:
        """Create node ``name`` or update the fields given (others keep their values)."""
        if state is not None:
            _check_state(state, NODE_STATES, "node state")
        with self.transaction():
            self._x("INSERT INTO nodes (name) VALUES (?) ON CONFLICT(name) DO NOTHING", (name,))
            sets, params = [], []
            for col, val in (("state", state), ("health", health), ("agent_version", agent_version),
                             ("last_seen", last_seen)):
                if val is not None:
                    sets.append(f"{col} = ?")
                    params.append(val)
            if health_detail is not None:
                sets.append("health_detail = ?")
                params.append(dumps(health_detail))
            if sets:
                self._x(f"UPDATE nodes SET {', '.join(sets)} WHERE name = ?", (*params, name))

    def set_node_state(self, name: str, state: str) -> None:
        self.upsert_node(name, state=state)

    def nodes(self) -> list[Node]:
        with self.snapshot():
            rows = self._q("SELECT * FROM nodes ORDER BY name")
        return [_row_node(r) for r in rows]

    def node(self, name: str) -> Node | None:
        """One node by name (a keyed lookup: every node report asks, so not a scan of every node)."""
        with self.snapshot():
            rows = self._q("SELECT * FROM nodes WHERE name = ?", (name,))
        return _row_node(rows[0]) if rows else None

    # -- observed state ---------------------------------------------------------
    def replace_observed(self, node: str, gpus: Iterable[Any], instances: Iterable[Any], *,
                         now: float | None = None, state: str = "up", health: str | None = None,
                         health_detail: dict | None = None, agent_version: str | None = None) -> None:
        """Replace everything known about ``node``'s GPUs and MIG instances with this report, atomically.

        ``gpus``: ObservedGpu / nvml GpuInfo / dicts (gpu or index, uuid, model, mig_enabled, name).
        ``instances``: ObservedInstance / nvml MigInstance / dicts (gpu, profile, start, uuid, gi_id,
        ci_id, in_use). Profiles given as kinds ("3g") are stored as full names. Marks the node seen.
        """
        t = _now(now)
        gpu_rows = [as_observed_gpu(g) for g in gpus]
        inst_rows = [as_observed_instance(i) for i in instances]
        # A model this slurm-mig's tables do not list (a newer node's) is stored as named, the GPU blocked
        # (as_observed_gpu); so is a GPU named no model that holds instances, and one of a known model whose
        # instances that model's table does not allow (a newer node's profile or placement): their profiles are
        # kept as given, and nothing reads a geometry from them (readable_model).
        by_gpu: dict[int, list[ObservedInstance]] = {}
        for i in inst_rows:
            by_gpu.setdefault(i.gpu, []).append(i)
        models = {g.gpu: readable_model(g.model, by_gpu.get(g.gpu, ())) for g in gpu_rows}
        gpu_rows = [g if models.get(g.gpu) is not None else self._with_unknown_reason(g, by_gpu.get(g.gpu, ()))
                    for g in gpu_rows]
        if len(models) != len(gpu_rows):
            raise ValueError(f"node {node} reported the same GPU index twice")
        normalised = []
        for i in inst_rows:
            if i.gpu not in models:
                raise ValueError(f"node {node} reported a MIG instance on GPU {i.gpu}, which it did not list")
            m = models[i.gpu]
            profile = m.profile(i.profile).name if m is not None else i.profile
            normalised.append((i, profile))
        with self.transaction():
            self.upsert_node(node, state=state, health=health, health_detail=health_detail,
                             agent_version=agent_version, last_seen=t)
            self._x("DELETE FROM instances WHERE node = ?", (node,))
            self._x("DELETE FROM gpus WHERE node = ?", (node,))
            for g in gpu_rows:
                self._x(
                    "INSERT INTO gpus (node, gpu, uuid, name, model, mig_enabled, last_observed, blocked) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (node, g.gpu, g.uuid, g.name, g.model, int(g.mig_enabled), t, g.blocked),
                )
            for i, profile in normalised:
                self._x(
                    "INSERT INTO instances (node, gpu, profile, start, uuid, gi_id, ci_id, in_use, observed_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (node, i.gpu, profile, i.start, i.uuid, i.gi_id, i.ci_id, int(i.in_use), t),
                )

    @staticmethod
    def _with_unknown_reason(g: ObservedGpu, instances: Iterable[ObservedInstance]) -> ObservedGpu:
        """``g`` blocked with unknown_model_reason's words too, where they apply and it does not say them yet."""
        why = unknown_model_reason(g.model, instances)
        if why is None or why in (g.blocked or ""):
            return g
        return dataclasses.replace(g, blocked="; ".join(filter(None, (why, g.blocked))))

    def observed_gpus(self, node: str | None = None) -> list[ObservedGpu]:
        sql, params = "SELECT * FROM gpus", ()
        if node is not None:
            sql, params = sql + " WHERE node = ?", (node,)
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu", params)
        return [ObservedGpu(r["gpu"], r["uuid"], r["model"], bool(r["mig_enabled"]), r["name"], r["last_observed"],
                            r["node"], r.get("blocked")) for r in rows]  # (no column before schema 5)

    def observed_instances(self, node: str | None = None, gpu: int | None = None) -> list[ObservedInstance]:
        where, params = [], []
        if node is not None:
            where.append("node = ?")
            params.append(node)
        if gpu is not None:
            where.append("gpu = ?")
            params.append(gpu)
        sql = "SELECT * FROM instances" + (" WHERE " + " AND ".join(where) if where else "")
        with self.snapshot():
            rows = self._q(sql + " ORDER BY node, gpu, start", params)
        return [ObservedInstance(r["gpu"], r["profile"], r["start"], r["uuid"], r["gi_id"], r["ci_id"],
                                 bool(r["in_use"]), r["observed_at"], r["node"]) for r in rows]

    def observed_layout(self, node: str, gpu: int) -> Layout | None:
        """The layout ``node``/``gpu`` last reported, or None if the GPU or its model is unknown."""
        with self.snapshot():
            g = self._q("SELECT model FROM gpus WHERE node = ? AND gpu = ?", (node, gpu))
            if not g or known_model(g[0]["model"]) is None:
                return None
            rows = self._q("SELECT profile, start FROM instances WHERE node = ? AND gpu = ?", (node, gpu))
        model = readable_model(g[0]["model"], rows)  # None: instances its table does not allow (a newer node's)
        if model is None:
            return None
        return Layout(model, frozenset(Slot(r["start"], r["profile"]) for r in rows))
