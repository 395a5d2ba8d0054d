"""scripts/bootstrap.sh, run against a stub interpreter: what it asks pip to install, and with which pins."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_STUB_PYTHON = """#!/bin/sh
printf '%s|%s\\n' "${PIP_CONSTRAINT:-}" "$*" >> "$(dirname "$0")/../../calls"
exit 0
"""


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


@pytest.fixture
def fake_checkout(tmp_path):
    """A copy of the files bootstrap.sh reads, with a .venv whose python only records its calls."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", root / "scripts")
    for name in ("constraints.txt", "pyproject.toml"):
        shutil.copy(REPO / name, root)
    py = root / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(_STUB_PYTHON)
    py.chmod(0o755)
    return root


@pytest.mark.parametrize("flags", [[], ["--training"]])
def test_every_install_and_the_build_backend_are_pinned(fake_checkout, flags):
    subprocess.run(["bash", "scripts/bootstrap.sh", *flags], cwd=fake_checkout, check=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"})
    calls = [c.split("|", 1) for c in (fake_checkout / "calls").read_text().splitlines()]
    installs = [(env, argv) for env, argv in calls if argv.startswith("-m pip install")]
    assert installs
    for env, argv in installs:
        assert "-c constraints.txt" in argv
        # pip's isolated build environment (where setuptools comes from) ignores -c; it reads PIP_CONSTRAINT.
        assert env == (fake_checkout / "constraints.txt").as_uri(), argv
    build_requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    pins = _pins()
    for req in build_requires:
        name = re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0]
        assert re.sub(r"[-_.]+", "-", name).lower() in pins, f"build requirement {req} is not pinned in constraints.txt"
    assert (fake_checkout / ".venv" / ".installed").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="bootstrap installs Slurm only as root")
@pytest.mark.parametrize("flags", [[], ["--training"]])
def test_a_failed_slurm_install_leaves_no_installed_marker(fake_checkout, flags):
    """`make` skips bootstrap while .venv/.installed* exist: a run that failed must not leave them."""
    py = fake_checkout / ".venv" / "bin" / "python"
    py.write_text(_STUB_PYTHON.replace("exit 0", 'case "$*" in *localcluster*) echo "apt-get failed" >&2; exit 1;; esac'))
    res = subprocess.run(["bash", "scripts/bootstrap.sh", *flags], cwd=fake_checkout, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode != 0 and "apt-get failed" in res.stderr
    assert sorted(p.name for p in (fake_checkout / ".venv").glob(".installed*")) == []


def test_pip_constraint_survives_a_checkout_path_with_a_space(tmp_path, fake_checkout):
    """pip splits PIP_CONSTRAINT on whitespace: '/home/a/my repo/constraints.txt' named '/home/a/my' and
    'repo/constraints.txt', and every install failed 'Could not open requirements file'."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    spaced = tmp_path / "my repo"
    shutil.move(fake_checkout, spaced)
    subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=spaced, check=True, timeout=60,
                   env={k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"})
    calls = [c.split("|", 1) for c in (spaced / "calls").read_text().splitlines()]
    envs = {env for env, argv in calls if argv.startswith("-m pip install")}
    assert envs
    for env in envs:
        (one,) = env.split()  # what pip reads
        assert Path(url2pathname(urlparse(one).path)) == spaced / "constraints.txt"
