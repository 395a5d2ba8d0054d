"""`slurm-mig demo --state-dir DIR` deletes DIR/state.db on every start: only in a directory it made its own."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from slurm_mig.cli import main
from slurm_mig.democluster import CONFIG_TEMPLATE, MARKER, DemoCluster
from slurm_mig.errors import ConfigError
from slurm_mig.store import open_store


@pytest.fixture
def tmp_path():
    """A short directory: slurmd's socket paths under the demo's state dir must fit in 107 bytes."""
    d = Path(tempfile.mkdtemp(prefix="smd", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _site_db(d):
    d.mkdir()
    with open_store(d / "state.db") as s:
        s.add_event("test", "a site's history", now=1.0)
    return (d / "state.db").read_bytes()


def test_a_state_db_the_demo_did_not_create_is_kept(tmp_path):
    d = tmp_path / "site"
    before = _site_db(d)
    with pytest.raises(ConfigError, match="did not create"):
        DemoCluster(d).reset_gpus()
    assert (d / "state.db").read_bytes() == before
    assert not (d / MARKER).exists() and not (d / "gpus").exists()


def test_the_demo_resets_its_own_state_dir(tmp_path):
    d = tmp_path / "new" / "demo"
    dc = DemoCluster(d)
    dc.reset_gpus()  # a new dir becomes the demo's
    assert (d / MARKER).is_file()
    with open_store(d / "state.db") as s:
        s.add_event("test", "the last demo run", now=1.0)
    dc.reset_gpus()
    assert not (d / "state.db").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    DemoCluster(empty).reset_gpus()  # an empty dir holds nothing to lose
    assert (empty / MARKER).is_file()


def test_demo_command_refuses_before_starting_anything(tmp_path, monkeypatch, capsys):
    def no_slurm(*a, **k):
        raise AssertionError("the demo went on to start Slurm")

    monkeypatch.setattr("slurm_mig.slurm.localcluster.LocalCluster.ensure_installed", no_slurm)
    d = tmp_path / "site"
    before = _site_db(d)
    assert main(["demo", "--state-dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "choose another --state-dir" in err and "Traceback" not in err
    assert (d / "state.db").read_bytes() == before and sorted(p.name for p in d.iterdir()) == ["state.db"]


def test_a_demo_dir_from_before_the_marker_is_still_the_demos(tmp_path):
    """`make demo` on a machine that ran an older version: its dir holds the config the demo generates."""
    d = tmp_path / "old-demo"
    _site_db(d)
    (d / "slurm-mig.toml").write_text(CONFIG_TEMPLATE.splitlines()[0] + "\n[controller]\n")
    DemoCluster(d).reset_gpus()
    assert (d / MARKER).is_file() and not (d / "state.db").exists()
    site = tmp_path / "site"
    _site_db(site)
    (site / "slurm-mig.toml").write_text("# our production config\n")
    with pytest.raises(ConfigError, match="did not create"):
        DemoCluster(site).reset_gpus()


def test_the_config_the_demo_writes_passes_the_controllers_trust_check(tmp_path):
    """The controller (and, as root, the hooks) refuse a config others may change (config.check_trusted): the
    demo's own, in its state dir, must pass, or the demo would stop at its controller's start."""
    import os

    from slurm_mig.config import check_trusted, load_config

    d = tmp_path / "demo"
    dc = DemoCluster(d)
    dc.claim_state_dir()
    os.chmod(d, 0o711)
    dc.port = 12345
    dc.write_config()
    check_trusted(dc.config_path, "the controller", only_as_root=False)
    assert load_config(dc.config_path).controller.listen_port == 12345
    if os.geteuid() == 0:  # the same state dir under a folder another user owns is refused before Slurm starts
        os.chown(tmp_path, 65534, 65534)
        try:
            with pytest.raises(ConfigError, match=f"owned by uid 65534.*chown root {tmp_path}"):
                dc.write_config()
        finally:
            os.chown(tmp_path, 0, 0)


def test_the_demo_makes_its_folders_with_sane_modes_whatever_the_umask(tmp_path):
    """Under umask 0, mkdir(parents=True) made the state dir's folders, those above it and Slurm's 0777: the
    controller's trust check (config.check_trusted) refused the demo's own config, and munged refuses a key or
    socket under a folder others may write. No Slurm is started: the folders and files written before it."""
    import os

    from slurm_mig.config import check_trusted

    d = tmp_path / "new" / "demo"
    old = os.umask(0)
    try:
        dc = DemoCluster(d)
        dc.reset_gpus()
        dc.port = 12345
        dc.write_config()
        dc.cluster._write_config(12346, list(range(12347, 12347 + len(dc.nodes) + 1)))
        check_trusted(dc.config_path, "the controller", only_as_root=False)
    finally:
        os.umask(old)
    folders = [p for p in (tmp_path / "new").rglob("*") if p.is_dir()] + [tmp_path / "new"]
    assert {"gpus", "log", "node", "slurm", "etc", "hooks"} <= {p.name for p in folders}
    loose = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in folders
             if p.stat().st_mode & 0o022}
    assert loose == {}
    assert d.stat().st_mode & 0o777 == 0o711
    assert (d / MARKER).stat().st_mode & 0o777 == 0o644


def test_the_folders_the_demos_config_names_pass_the_written_folder_check(tmp_path):
    """The controller and the root hooks refuse a config naming a folder others may change for the files they
    write ([log].file, db_path, cache_dir, sim_state_path: config.check_written_folders). The demo's are all in its
    state dir (0711) and its folders (0755): they pass, judged as root judges them (no Slurm is started), and the
    demo's own check says so before Slurm starts when one is loosened."""
    import os

    from slurm_mig.config import check_written_folders, load_config, written_folders

    d = tmp_path / "demo"
    dc = DemoCluster(d)
    dc.claim_state_dir()
    dc.port = 12345
    dc.write_config()
    cfg = load_config(dc.config_path)
    keys = [k for k, _, _ in written_folders(cfg, controller=True, node=True)]
    assert keys == ["[log].file", "[controller].db_path", "[node].cache_dir", "[node].sim_state_path"]
    assert all(str(folder).startswith(str(d)) for _, _, folder in written_folders(cfg, controller=True, node=True))
    check_written_folders(cfg, "the controller", controller=True, only_as_root=False)
    check_written_folders(cfg, "a hook", node=True, only_as_root=False)
    (d / "log").chmod(0o777)
    try:
        with pytest.raises(ConfigError, match=r"\[log\]\.file = .*folder .*/demo/log is writable by anyone"):
            dc.write_config()
    finally:
        (d / "log").chmod(0o755)
    dc.write_config()
    # The documented defaults pass as well (on this machine: folders root made 0755, or missing below them)
    from dataclasses import replace

    from slurm_mig.config import Config, LogConfig

    dflt = replace(Config(), log=LogConfig(file="/var/log/slurm-mig/controller.log"))
    check_written_folders(dflt, "the controller", controller=True, node=True, only_as_root=False)


def test_the_demos_files_are_never_more_open_than_their_modes_whatever_the_umask(tmp_path):
    """Under umask 0 the demo wrote its config and its state dir's marker with write_text and chmod-ed them 0644
    after: 0666 until the chmod, and whoever opened the config then could rewrite it after the demo checked it
    (the controller's config). Slurm's files (slurm.conf, whose Prolog slurmd runs as root; cluster.json) and the
    hook wrappers were left 0666 for good. Each is now made with its mode: told by the modes open(), os.mkdir
    and os.chmod were given (audit events), not only by the modes at the end. No Slurm is started."""
    import os
    import stat

    from tests.helpers import modes_given, wider_than_final

    d = tmp_path / "new" / "demo"
    old = os.umask(0)
    try:
        with modes_given() as seen:
            dc = DemoCluster(d)
            dc.reset_gpus()
            dc.port = 12345
            dc.write_config()
            dc.cluster._write_config(12346, list(range(12347, 12347 + len(dc.nodes) + 1)))
    finally:
        os.umask(old)
    assert wider_than_final(seen, 0) == []
    files = {str(p.relative_to(d)): stat.S_IMODE(p.stat().st_mode) for p in d.rglob("*")
             if p.is_file() and p.suffix in (".toml", ".conf", ".json", ".lua", ".sh", "")}
    assert files and {f: oct(m) for f, m in files.items() if m & 0o022} == {}, files
    assert files[dc.config_path.name] == 0o644 and files[MARKER] == 0o644
