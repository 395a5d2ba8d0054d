"""The runtime never imports training libraries, and the node hooks import nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING_ONLY = {"torch", "gymnasium", "stable_baselines3", "sb3_contrib", "onnx", "onnxscript"}
# What a hook process must not load: slow imports (FACTS §6) or head-node-only libraries.
HOOK_FORBIDDEN = TRAINING_ONLY | {"onnxruntime", "numpy", "rich", "sqlite_utils", "apscheduler", "matplotlib"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_runtime_packages_never_import_training_libraries():
    offenders = {}
    for folder in ("slurm_mig", "prolog", "epilog"):
        for path in (ROOT / folder).rglob("*.py"):
            bad = _imports(path) & TRAINING_ONLY
            if bad:
                offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert not offenders, offenders


def test_hook_process_imports_stay_light():
    code = (
        "import sys\n"
        "import slurm_mig.node.hooks, slurm_mig.node.localstate, slurm_mig.api.client, slurm_mig.api.auth\n"
        "import slurm_mig.node.prolog, slurm_mig.node.taskprolog, slurm_mig.node.epilog, slurm_mig.node.healthcheck\n"
        "import slurm_mig.config, slurm_mig.nvml, slurm_mig.nvml.simulated, slurm_mig.nvml.real, slurm_mig.nvml.apply\n"
        "import slurm_mig.mig.transitions, slurm_mig.slurm.runner, slurm_mig.slurm.gres, slurm_mig.slurm.parsers\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = set(out.stdout.split())
    assert not loaded & HOOK_FORBIDDEN, sorted(loaded & HOOK_FORBIDDEN)
    assert "pynvml" not in loaded  # the real backend imports NVML lazily, on first use


def test_the_store_does_not_import_the_controller():
    # The policy's guess at a started job's Prolog choice is the controller's (cluster_state's prolog_choice):
    # the store once imported controller/binding.py inside cluster_state to build it again by itself.
    offenders = {}
    for path in (ROOT / "slurm_mig" / "store").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "slurm_mig.controller" or n.startswith("slurm_mig.controller.") for n in names):
                offenders.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    assert not offenders, offenders
