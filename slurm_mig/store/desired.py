"""The layouts the policy wants on each GPU (table desired_layouts)."""

from __future__ import annotations

from slurm_mig.mig.layout import Layout
from slurm_mig.store.models import DesiredLayout
from slurm_mig.store.rows import _now


class DesiredLayoutsMixin:
    """Store methods on the layouts the policy wants (table desired_layouts)."""

    # -- desired layouts --------------------------------------------------------
    def set_desired(self, node: str, gpu: int, layout: Layout | str, policy: str, reason: str = "", *,
                    now: float | None = None) -> None:
        """Record the layout a policy wants on ``node``/``gpu`` (a Layout or a parse_layout() spec)."""
        spec = str(layout) if isinstance(layout, Layout) else str(layout).strip()
        with self.transaction():
            self._x(
                "INSERT INTO desired_layouts (node, gpu, layout, policy, decided_at, reason) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(node, gpu) DO UPDATE SET layout = excluded.layout, policy = excluded.policy, "
                "decided_at = excluded.decided_at, reason = excluded.reason",
                (node, int(gpu), spec, policy, _now(now), reason),
            )

    def clear_desired(self, node: str, gpu: int | None = None) -> None:
        with self.transaction():
            if gpu is None:
                self._x("DELETE FROM desired_layouts WHERE node = ?", (node,))
            else:
                self._x("DELETE FROM desired_layouts WHERE node = ? AND gpu = ?", (node, int(gpu)))

    def desired(self, node: str) -> dict[int, DesiredLayout]:
        """The desired layout of each GPU of ``node`` that has one, by GPU index."""
        with self.snapshot():
            rows = self._q(
                "SELECT d.*, g.model AS model FROM desired_layouts d "
                "LEFT JOIN gpus g ON g.node = d.node AND g.gpu = d.gpu WHERE d.node = ? ORDER BY d.gpu",
                (node,),
            )
        return {r["gpu"]: DesiredLayout(r["node"], r["gpu"], r["layout"], r["policy"], r["decided_at"], r["reason"],
                                        r["model"]) for r in rows}
