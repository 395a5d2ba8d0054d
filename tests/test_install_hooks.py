"""`slurm-mig install-hooks`: the paths it writes into the root hooks' shell text."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from slurm_mig.errors import SlurmMigError
from slurm_mig.node.cli import HOOKS, install_hooks


def test_installs_every_hook_with_its_interpreter_and_config(tmp_path):
    out = install_hooks(tmp_path / "hooks", "/opt/slurm-mig/venv/bin/python3", "/etc/slurm-mig/site.toml")
    assert set(out) == set(HOOKS)
    for path in out.values():
        text = path.read_text()
        assert ': "${SLURM_MIG_PYTHON:=/opt/slurm-mig/venv/bin/python3}"' in text
        assert ': "${SLURM_MIG_CONFIG:=/etc/slurm-mig/site.toml}"' in text
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o755
        assert subprocess.run(["sh", "-n", str(path)]).returncode == 0  # still valid shell


@pytest.mark.parametrize("python,config", [
    ("/usr/bin/python3", '/etc/x"; reboot; ".toml'),
    ("/usr/bin/python3$(id)", "/etc/slurm-mig/slurm-mig.toml"),
    ("/usr/bin/python3", "/etc/slurm mig/slurm-mig.toml"),
    ("/usr/bin/python3", "/etc/x}.toml"),
    ("/usr/bin/python3", "/etc/x\n/bin/sh"),
    ("python3", "/etc/slurm-mig/slurm-mig.toml"),  # relative: depends on slurmd's PATH and folder
    ("/usr/bin/`id`", "/etc/slurm-mig/slurm-mig.toml"),
])
def test_refuses_paths_the_shell_would_read_and_writes_nothing(tmp_path, python, config):
    with pytest.raises(SlurmMigError, match="absolute path"):
        install_hooks(tmp_path / "hooks", python, config)
    assert not (tmp_path / "hooks").exists()
