"""etc/slurm-mig-controller.service and etc/logrotate.slurm-mig: valid, and consistent with the code."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_mig.cli import build_parser
from slurm_mig.config import SYSTEM_PATH, ControllerConfig

ETC = Path(__file__).resolve().parents[1] / "etc"
UNIT = ETC / "slurm-mig-controller.service"
LOGROTATE = ETC / "logrotate.slurm-mig"


def unit() -> configparser.RawConfigParser:
    cp = configparser.RawConfigParser(strict=True, interpolation=None, comment_prefixes=("#",))
    cp.optionxform = str
    cp.read_string(UNIT.read_text())
    return cp


def test_unit_runs_the_controller_with_the_system_config():
    u = unit()
    argv = shlex.split(u["Service"]["ExecStart"])
    assert argv[0].endswith("/bin/slurm-mig") and os.path.isabs(argv[0])
    args = build_parser().parse_args(argv[1:])
    assert args.command == "controller" and not args.once
    assert args.config == str(SYSTEM_PATH)
    assert u["Service"]["Environment"] == f"SLURM_MIG_CONFIG={SYSTEM_PATH}"
    assert u["Service"]["Restart"] == "on-failure"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert "munge.service" in u["Unit"]["After"] and "slurmctld.service" in u["Unit"]["After"]


def test_unit_state_and_log_folders_match_the_defaults():
    u = unit()
    assert Path(ControllerConfig().db_path).parent == Path("/var/lib") / u["Service"]["StateDirectory"]
    logs = Path("/var/log") / u["Service"]["LogsDirectory"]
    assert f"{logs}/*.log" in LOGROTATE.read_text()
    # ProtectSystem=full keeps /var writable: the database and logs must not need more.
    assert u["Service"]["ProtectSystem"] == "full"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path):
    text = UNIT.read_text()
    exe = shlex.split(unit()["Service"]["ExecStart"])[0]
    path = tmp_path / "slurm-mig-controller.service"
    path.write_text(text.replace(exe, "/bin/true"))  # verify wants an executable that exists here
    res = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in res.stderr.splitlines() if str(path) in line]
    assert res.returncode == 0 and not complaints, res.stderr


@pytest.mark.skipif(shutil.which("logrotate") is None and not os.path.exists("/usr/sbin/logrotate"),
                    reason="logrotate not installed")
def test_logrotate_rules_rotate_and_truncate_in_place(tmp_path):
    exe = shutil.which("logrotate") or "/usr/sbin/logrotate"
    logs = tmp_path / "log"
    logs.mkdir(mode=0o750)
    log = logs / "slurm-mig.log"
    log.write_text("line\n" * 100)
    inode = log.stat().st_ino
    conf = tmp_path / "slurm-mig"
    conf.write_text(LOGROTATE.read_text().replace("/var/log/slurm-mig", str(logs)))
    res = subprocess.run([exe, "-f", "-s", str(tmp_path / "state"), str(conf)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert (logs / "slurm-mig.log.1").read_text() == "line\n" * 100  # delaycompress: first copy plain
    assert log.stat().st_ino == inode and log.stat().st_size == 0  # copytruncate: same file, emptied


def test_a_wheel_carries_every_file_of_etc_and_every_hook():
    """An admin who installs from a wheel must find them under share/slurm-mig/ (admin guide, step 2);
    cli_filter.lua was missing, and without it every sbatch on a host with CliFilterPlugins=lua fails."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["data-files"]
    shipped = {f for files in data.values() for f in files}
    wanted = {f"etc/{p.name}" for p in (root / "etc").iterdir() if p.is_file()}
    wanted |= {f"{d}/{p.name}" for d in ("prolog", "epilog") for p in (root / d).iterdir()
               if p.is_file() and p.name.startswith("slurm-mig-")}
    assert wanted - shipped == set()
