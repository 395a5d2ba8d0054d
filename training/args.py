"""Command-line flags from a dataclass of arguments, each documented by its one-line comment.

The training scripts (train.py, guard.py, modes.py) keep their arguments in a dataclass whose
fields carry a trailing ``# comment``, the way CleanRL does. ``parse_args`` turns every field
into a ``--flag`` and shows that comment as the flag's help, so ``--help`` reads like the class:

* ``bool`` fields are switches (``--smoke``);
* tuple fields take comma-separated values, each converted to the type of the default's
  elements (``--episode-jobs 60,90`` gives ``(60, 90)``);
* everything else is converted to the type of its default.
"""

from __future__ import annotations

import argparse
import inspect
import io
import tokenize
from dataclasses import MISSING, fields


def field_docs(cls: type) -> dict[str, str]:
    """Each field's trailing comment in ``cls``'s source (``name: type = default  # doc``)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    names: dict[int, str] = {}  # line -> the field named at its start
    # Tokens, not a regex: a default may be a string that holds "#".
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        row = tok.start[0]
        if tok.type == tokenize.NAME and row not in names and tok.line[:tok.start[1]].strip() == "":
            names[row] = tok.string
        elif tok.type == tokenize.COMMENT and row in names and tok.line[:tok.start[1]].strip():
            docs.setdefault(names[row], tok.string.lstrip("#").strip())
    return docs


def _tuple_of(default: tuple):
    kind = type(default[0]) if default else str

    def convert(text: str) -> tuple:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return tuple(kind(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated {kind.__name__} values")

    return convert


def parse_args(cls: type, argv: list[str] | None = None, description: str | None = None):
    """An instance of the dataclass ``cls`` with the values given on the command line."""
    docs = field_docs(cls)
    ap = argparse.ArgumentParser(description=description)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        doc = docs.get(f.name, "")
        if isinstance(default, bool):
            kind, help_ = {"action": "store_true"}, doc
        elif isinstance(default, tuple):
            shown = ",".join(str(v) for v in default)
            kind, help_ = {"type": _tuple_of(default)}, f"{doc} (comma-separated; default {shown})"
        else:
            kind, help_ = {"type": type(default)}, f"{doc} (default {default!r})"
        # argparse formats help with %: "55 %" in a comment must reach it as "55 %%"
        ap.add_argument(flag, default=default, help=help_.strip().replace("%", "%%"), **kind)
    return cls(**vars(ap.parse_args(argv)))
