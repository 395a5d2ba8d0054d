"""The admin/user/operator docs cannot drift from the code: commands, keys, metrics, files, links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_mig.cli import build_parser
from slurm_mig.config import RULES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["admin-guide.md", "user-guide.md", "operator-guide.md", "architecture.md", "metrics.md",
        "failure-modes.md"]


def text(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


@pytest.mark.parametrize("doc", DOCS)
def test_every_slurm_mig_command_in_the_docs_exists(doc):
    known = commands()
    # invocations: `slurm-mig x`, "$ slurm-mig x", ".../bin/slurm-mig x" (prose like "slurm-mig never" is not one)
    used = set(re.findall(r"(?:`|\$ |/bin/)slurm-mig (?:--config \S+ )?([a-z][a-z-]+)", text(doc)))
    missing = used - known
    assert not missing, f"{doc} names slurm-mig commands that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS)
def test_config_keys_in_the_docs_exist(doc):
    for section, key in re.findall(r"\[([a-z]+)\]\.([a-z_]+)", text(doc)):
        assert section in RULES and key in RULES[section], f"{doc}: [{section}].{key} is not a config key"


@pytest.mark.parametrize("doc", DOCS)
def test_files_and_links_in_the_docs_exist(doc):
    t = text(doc)
    for path in re.findall(r"`((?:etc|prolog|epilog|tests|slurm_mig)/[A-Za-z0-9_][A-Za-z0-9_./-]*)`", t):
        assert (ROOT / path.rstrip("/")).exists(), f"{doc} names {path}, which does not exist"
    for link in re.findall(r"\]\(([A-Za-z0-9_.-]+\.md)\)", t):
        assert (ROOT / "docs" / link).exists(), f"{doc} links to {link}, which does not exist"


def code_metrics() -> set[str]:
    names = set()
    for path in list((ROOT / "slurm_mig" / "controller").glob("*.py")) + list((ROOT / "slurm_mig" / "api").glob("*.py")):
        names |= set(re.findall(r'"(slurm_mig_[a-z_]+)"', path.read_text()))
    return names


def test_metrics_doc_lists_exactly_the_controllers_series():
    documented = set(re.findall(r"^\| `(slurm_mig_[a-z_]+)` \|", text("metrics.md"), re.M))
    assert documented == code_metrics(), (
        f"only in docs/metrics.md: {sorted(documented - code_metrics())}; "
        f"only in the code: {sorted(code_metrics() - documented)}")
    # every PromQL example uses documented series (histograms through _bucket/_sum/_count)
    used = set(re.findall(r"(slurm_mig_[a-z_]+)", text("metrics.md")))
    base = {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}
    assert base <= documented, sorted(base - documented)


def test_screen_captures_in_the_docs_are_80_columns():
    t = text("operator-guide.md")
    block = t.split("What the demo cluster looks like in an 80x24 terminal", 1)[1].split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
