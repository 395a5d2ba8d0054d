"""The start of a training run and its log, the same for training/train.py and training/modes.py.

``start_run(args)`` sets torch's threads, seeds python, numpy and torch from ``args.seed``, makes the
output folder ``args.out`` and opens its ``log.jsonl``; it returns the run's own random generators
(python's, drawn from for episodes, and numpy's), the folder and the log. ``log(**kv)`` writes one
JSON line with the seconds since the start (``elapsed_s``) and, with ``echo``, prints it as
``key=value`` words.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch


class RunLog:
    """One JSON line per call, to ``path``; ``t_start`` is the run's start (time.time())."""

    def __init__(self, path: Path, t_start: float, echo: bool = True):
        self.t_start = t_start
        self.echo = echo
        self._f = path.open("w")

    def __call__(self, **kv) -> None:
        kv["elapsed_s"] = round(time.time() - self.t_start, 1)
        self._f.write(json.dumps(kv) + "\n")
        self._f.flush()
        if self.echo:
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items()), flush=True)

    def close(self) -> None:
        self._f.close()


def start_run(args, *, echo: bool = True) -> tuple[random.Random, np.random.Generator, Path, RunLog]:
    """Seed everything from ``args.seed`` (``args.threads`` torch threads), make ``args.out`` and open its
    log.jsonl. Returns (rng, nprng, out, log)."""
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return rng, nprng, out, RunLog(out / "log.jsonl", t_start, echo)
