"""`slurm-mig layouts` and `slurm-mig profiles`: look at the MIG geometry tables."""

from __future__ import annotations

import argparse
import json

from slurm_mig.mig.layout import enumerate_maximal_layouts
from slurm_mig.mig.profiles import GPU_MODELS, get_model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("layouts", help="list the maximal MIG layouts of a GPU model")
    p.add_argument("--gpu", default="H100-80GB", help=f"GPU model ({', '.join(GPU_MODELS)}; default H100-80GB)")
    p.add_argument("--json", action="store_true", help="print a JSON list of layouts")
    p.set_defaults(func=_layouts)

    p = sub.add_parser("profiles", help="list a GPU model's MIG profiles and placements")
    p.add_argument("--gpu", default="H100-80GB", help="GPU model (default H100-80GB)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_profiles)


def _layouts(args: argparse.Namespace) -> int:
    model = get_model(args.gpu)
    layouts = enumerate_maximal_layouts(model)
    if args.json:
        print(json.dumps([l.to_json() for l in layouts]))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(layouts)} maximal layouts of {model.name} (1g/2g/3g/4g/7g)")
    table.add_column("#", justify="right")
    table.add_column("layout (profile@start)")
    table.add_column("memory slices 0..%d" % (model.memory_slices - 1))
    for i, layout in enumerate(layouts, 1):
        cells = ["."] * model.memory_slices
        for s in layout.sorted_slots():
            p = model.profile(s.profile)
            for k in range(s.start, s.start + p.memory_slices):
                cells[k] = p.kind[0]
        table.add_row(str(i), str(layout), " ".join(cells))
    Console().print(table)
    return 0


def _profiles(args: argparse.Namespace) -> int:
    model = get_model(args.gpu)
    rows = [
        {"id": p.id, "name": p.name, "kind": p.kind, "compute_slices": p.compute_slices,
         "memory_slices": p.memory_slices, "memory_gb": p.memory_gb, "max_count": p.max_count,
         "starts": list(p.starts)}
        for p in model.profiles
    ]
    if args.json:
        print(json.dumps({"model": model.name, "memory_slices": model.memory_slices,
                          "compute_slices": model.compute_slices, "profiles": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model.name}: {model.compute_slices} compute / {model.memory_slices} memory slices")
    for col in ("id", "name", "kind", "compute", "memory slices", "max", "placements (start:size)"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["id"]), r["name"], r["kind"], str(r["compute_slices"]), str(r["memory_slices"]),
                      str(r["max_count"]), ",".join(f"{s}:{r['memory_slices']}" for s in r["starts"]))
    Console().print(table)
    return 0
