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
    for name, path in out.items():
        text = path.read_text()
        if name == "slurm-mig-taskprolog":  # the job's environment must not choose them (test below)
            assert "\nSLURM_MIG_PYTHON=/opt/slurm-mig/venv/bin/python3\n" in text
            assert "\nSLURM_MIG_CONFIG=/etc/slurm-mig/site.toml\n" in text
        else:
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


def test_a_wheel_install_needs_no_checkout(tmp_path):
    """`pip install` on a node (no source checkout): the wheel carries the hooks, the shipped policy and
    etc/, and install-hooks finds them under <prefix>/share/slurm-mig."""
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    wheels = tmp_path / "wheels"
    # pip sees what PYTHONPATH holds as installed: with a checkout on it (PYTHONPATH=$PWD) and the egg-info
    # the wheel build leaves there, it skipped the install as "already satisfied", and the test failed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(repo)], check=True, capture_output=True, timeout=300, env=env)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (whl,) = wheels.glob("slurm_mig-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "-q", str(whl)], check=True, capture_output=True, timeout=300, env=env)
    share = venv / "share" / "slurm-mig"
    for rel in ("prolog/slurm-mig-prolog", "epilog/slurm-mig-epilog", "policy/default.onnx", "policy/guard.onnx",
                "policy/model_card.json", "etc/job_submit.lua", "etc/slurm.conf.snippet"):
        assert (share / rel).is_file(), rel
    code = ("from slurm_mig.node.cli import hook_source_dir, install_hooks; import sys; "
            "print(hook_source_dir()); install_hooks(sys.argv[1], '/usr/bin/python3', '/etc/slurm-mig/x.toml')")
    out = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code, str(tmp_path / "hooks")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == share
    # the rl policy finds the shipped model (and its guard) there too
    code = "from slurm_mig.policies.rl import SHIPPED_MODEL; print(SHIPPED_MODEL)"
    out = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and Path(out.stdout.strip()) == share / "policy" / "default.onnx", out.stderr
    assert sorted(p.name for p in (tmp_path / "hooks").iterdir()) == sorted(HOOKS)


def test_prolog_wrapper_requeues_and_holds_back_when_python_cannot_run(tmp_path):
    """Python missing or killed: the wrapper exits 0 (no drain), requeues the job and holds it back past
    cred_expire, read from Slurm's config (digits only reach the shell's arithmetic)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "$@" >> "$CALLS"\n'
                        'if [ "$1" = show ]; then echo "AuthInfo = cred_expire=30,socket=/x"; fi\n')
    scontrol.chmod(0o755)
    for python in ("/nonexistent/python3", "/bin/false"):
        calls.unlink(missing_ok=True)
        env = {"SLURM_MIG_PYTHON": python, "SLURM_MIG_CONFIG": "/nonexistent.toml", "SLURM_JOB_ID": "4242",
               "PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls)}
        out = subprocess.run(["/bin/sh", str(repo / "prolog" / "slurm-mig-prolog")], env=env, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert calls.read_text().splitlines() == ["requeue 4242", "show config",
                                                  "update JobId=4242 StartTime=now+40"]


def test_the_installed_taskprolog_ignores_the_jobs_slurm_mig_variables(tmp_path):
    """The TaskProlog runs with the job's environment: a user who exported SLURM_MIG_CONFIG for the
    command-line tools (or a SLURM_MIG_PYTHON) made it read another config, or run another interpreter,
    and the job silently got no GPU. The installed copy sets both itself."""
    import sys

    config = tmp_path / "site.toml"
    config.write_text(f'[node]\ncache_dir = "{tmp_path / "cache"}"\nnvml_backend = "simulated"\n'
                      f'sim_state_path = "{tmp_path / "gpus.json"}"\n')
    out = install_hooks(tmp_path / "hooks", sys.executable, str(config))
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_MIG_PYTHON": "/bin/false",
           "SLURM_MIG_CONFIG": str(tmp_path / "missing.toml")}
    res = subprocess.run(["/bin/sh", str(out["slurm-mig-taskprolog"])], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0
    assert "could not run" not in res.stderr, res.stderr  # the installed interpreter ran, not /bin/false
    assert "export CUDA_VISIBLE_DEVICES=" in res.stdout


def _run_install(tmp_path, *args):
    import sys

    return subprocess.run([sys.executable, "-m", "slurm_mig.cli", "install-hooks", "--prefix",
                           str(tmp_path / "hooks"), *args], capture_output=True, text=True, timeout=120)


def test_install_hooks_refuses_a_config_every_hook_would_fail_on_and_writes_nothing(tmp_path):
    """The hooks read the config they were installed with: a missing or wrong one failed every hook
    on the node (each Prolog requeued its job), while install-hooks said "installed"."""
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text('[controller]\ntick_interval_s = "fast"\n')
    for config, said in ((bad, "tick_interval_s"), (tmp_path / "missing.toml", "file not found")):
        res = _run_install(tmp_path, "--python", sys.executable, "--hook-config", str(config))
        assert res.returncode == 2, res.stderr
        assert said in res.stderr and "--hook-config" in res.stderr
        assert not (tmp_path / "hooks").exists()


def test_install_hooks_refuses_an_interpreter_without_slurm_mig(tmp_path):
    good = tmp_path / "site.toml"
    good.write_text("[controller]\ntick_interval_s = 5\n")
    for python, said in (("/usr/bin/python3", "cannot import slurm-mig"),  # Debian's, no slurm-mig in it
                         (str(tmp_path / "nopython"), "not an executable file")):
        res = _run_install(tmp_path, "--python", python, "--hook-config", str(good))
        assert res.returncode == 1, res.stderr
        assert said in res.stderr
        assert not (tmp_path / "hooks").exists()


def test_install_hooks_installs_with_a_good_config_and_interpreter(tmp_path):
    import sys

    good = tmp_path / "site.toml"
    good.write_text("[controller]\ntick_interval_s = 5\n")
    res = _run_install(tmp_path, "--python", sys.executable, "--hook-config", str(good))
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "hooks").iterdir()) == sorted(HOOKS)


def test_two_installs_at_once_both_finish_whole_and_each_hook_is_fsynced(tmp_path, monkeypatch):
    """Each hook went through a fixed ``<hook>.tmp`` with no fsync: a second install-hooks run between one's
    write and its rename (pdsh to every node twice, config management overlapping a manual run) took the
    temporary file away (the first died with FileNotFoundError, or renamed the other's half-written file
    into place), and a power cut could leave an empty hook, which slurmd cannot exec (a failed Prolog
    drains the node). Now folders.write_durably: a temporary file of its own, fsynced, renamed, folder
    fsynced."""
    prefix = tmp_path / "hooks"
    real_replace, real_fsync = os.replace, os.fsync
    nested, synced = [], set()

    def replace(src, dst, *a, **kw):
        if not nested:  # the second install runs between the first's write and its rename
            nested.append(dst)
            install_hooks(prefix, "/usr/bin/python3", "/etc/slurm-mig/b.toml")
        return real_replace(src, dst, *a, **kw)

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    out = install_hooks(prefix, "/usr/bin/python3", "/etc/slurm-mig/a.toml")
    assert nested
    assert sorted(p.name for p in prefix.iterdir()) == sorted(HOOKS)  # no temporary file left behind
    for name, path in out.items():
        text = path.read_text()
        assert "/etc/slurm-mig/a.toml" in text and "b.toml" not in text, name  # the later install's, whole
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
        assert os.stat(path).st_uid == os.geteuid()
        st = os.stat(path)
        assert (st.st_dev, st.st_ino) in synced, name
    st = os.stat(prefix)
    assert (st.st_dev, st.st_ino) in synced  # the renames themselves survive a power cut


def test_install_writes_through_no_link_planted_in_the_prefix(tmp_path):
    """Root wrote each hook through ``<prefix>/<hook>.tmp`` opened with O_TRUNC, following a symbolic link:
    one planted there (a prefix others can write) had root overwrite its target (say /etc/shadow) with the
    hook's text and chmod it 0755. A hook name that is a link is replaced, its target left alone."""
    prefix = tmp_path / "hooks"
    prefix.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.chmod(victim, 0o600)
    os.symlink(victim, prefix / "slurm-mig-prolog.tmp")
    os.symlink(victim, prefix / "slurm-mig-epilog")
    out = install_hooks(prefix, "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert victim.read_text() == "precious\n"
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    assert not out["slurm-mig-epilog"].is_symlink()
    assert "SLURM_MIG_CONFIG" in out["slurm-mig-epilog"].read_text()


def test_refuses_a_prefix_others_can_change_and_writes_nothing(tmp_path):
    """The hooks run as root from the prefix: whoever can write a folder on its way (not sticky) can rename
    it away and put their own prolog there. install-hooks made and wrote into any prefix it was given."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # group/world-writable, no sticky bit
    with pytest.raises(SlurmMigError, match=r"shared.*chmod go-w"):
        install_hooks(shared / "libexec" / "slurm-mig", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert list(shared.iterdir()) == []
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot rename what is not theirs
    out = install_hooks(shared / "slurm-mig", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert sorted(out) == sorted(HOOKS)
    # folders made on the way get 0755 whatever the umask (mkdir(parents=True) gave 0777 under umask 0)
    old = os.umask(0)
    try:
        install_hooks(tmp_path / "a" / "b", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder or link to another user")
def test_refuses_a_prefix_or_link_another_user_owns(tmp_path):
    """As root: a prefix another user made (in /tmp, say) is theirs to fill; a link another user planted
    sends root's hooks where they choose, and slurm.conf's path stays theirs to repoint."""
    os.chmod(tmp_path, 0o1777)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(SlurmMigError, match="uid 12345"):
        install_hooks(theirs, "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert list(theirs.iterdir()) == []
    safe = tmp_path / "safe"
    safe.mkdir()
    link = tmp_path / "link"
    os.symlink(safe, link)
    os.lchown(link, 12345, 12345)
    with pytest.raises(SlurmMigError, match="uid 12345"):
        install_hooks(link, "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert list(safe.iterdir()) == []
    os.lchown(link, 0, 0)  # root's own link to a folder of root's: fine
    assert sorted(install_hooks(link, "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")) == sorted(HOOKS)


def test_refuses_a_prefix_whose_dotdot_after_a_link_leads_into_another_users_folder(tmp_path):
    """_check_prefix resolved os.path.abspath(prefix), which drops 'link/..' by the letters where the kernel follows
    the link first: --prefix ROOTS/L/../hooks, L a link into a folder uid 12345 owns, was judged as ROOTS/hooks
    (root's) and the hooks were written into uid 12345's folder (their THEIRS/hooks, which they may swap for their
    own prolog for slurmd to run as root). The resolved pass now takes realpath of the prefix as given."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    theirs, roots = tmp_path / "theirs", tmp_path / "roots"
    (theirs / "sub").mkdir(parents=True)
    roots.mkdir()
    os.chown(theirs, 12345, 12345)
    os.symlink(theirs / "sub", roots / "L")
    with pytest.raises(SlurmMigError, match="uid 12345"):
        install_hooks(f"{roots}/L/../hooks", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert not (theirs / "hooks").exists() and not (roots / "hooks").exists()


def test_a_hook_source_without_its_line_is_an_error_and_nothing_is_written(tmp_path, monkeypatch):
    """A hook source without the line to set (not a slurm-mig checkout, an edited copy): install_hooks raised
    NameError (SlurmMigError was not imported there), after writing the hooks before it."""
    import shutil
    from pathlib import Path

    from slurm_mig.node import cli

    src = tmp_path / "src"
    repo = Path(__file__).resolve().parents[1]
    for folder in ("prolog", "epilog"):
        shutil.copytree(repo / folder, src / folder)
    (src / "epilog" / "slurm-mig-healthcheck").write_text("#!/bin/sh\nexit 0\n")
    monkeypatch.setattr(cli, "hook_source_dir", lambda: src)
    with pytest.raises(SlurmMigError, match="slurm-mig-healthcheck has no line"):
        install_hooks(tmp_path / "hooks", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert not (tmp_path / "hooks").exists() or list((tmp_path / "hooks").iterdir()) == []


@pytest.mark.parametrize("under", ["a-file", "a-file/hooks"])
def test_a_prefix_that_is_or_runs_through_a_file_is_an_error_and_changes_nothing(tmp_path, under):
    """`install-hooks --prefix <a file>` chmod-ed that file 0755 (executable) and then printed the
    NotADirectoryError traceback of the first hook's write (below a file, _check_prefix refused already).
    Found giving install-hooks a file for --prefix."""
    blocker = tmp_path / "a-file"
    blocker.write_text("notes\n")
    os.chmod(blocker, 0o600)
    with pytest.raises(SlurmMigError, match="--prefix .*a-file"):
        install_hooks(tmp_path / under, "/usr/bin/python3", "/etc/slurm-mig/x.toml")
    assert stat.S_IMODE(os.stat(blocker).st_mode) == 0o600 and blocker.read_text() == "notes\n"


def test_install_hooks_refuses_a_config_the_root_hooks_would_refuse(tmp_path):
    """The hooks, run as root, refuse a config others may change (every Prolog then requeues its job), while
    install-hooks installed them on it and said "installed". Found with a 0666 --hook-config. Refused now, by the
    hooks' own rule (config.check_trusted), before anything is written."""
    import os
    import sys

    if os.geteuid() != 0:
        pytest.skip("the hooks judge their config only as root")
    cfg = tmp_path / "site.toml"
    cfg.write_text("[controller]\ntick_interval_s = 5\n")
    cfg.chmod(0o666)
    res = _run_install(tmp_path, "--python", sys.executable, "--hook-config", str(cfg))
    assert res.returncode == 2 and "--hook-config" in res.stderr and f"chmod o-w {cfg}" in res.stderr, res.stderr
    assert not (tmp_path / "hooks").exists()
    cfg.chmod(0o644)
    assert _run_install(tmp_path, "--python", sys.executable, "--hook-config", str(cfg)).returncode == 0


def test_installs_into_the_folder_a_prefix_with_dotdot_after_a_link_opens(tmp_path):
    """--prefix ROOTS/L/../hooks, L root's link to root's OTHER/sub: the prefix is OTHER/hooks to the kernel (it
    follows L before ".."), and _check_prefix judges it so; but each hook was written through tempfile, which makes
    its folder absolute with os.path.abspath (ROOTS/hooks, by the letters): install-hooks made OTHER/hooks and
    failed with a FileNotFoundError traceback (reproduced; with a ROOTS/hooks there the temporary files were made
    in that other folder). write_durably now makes its temporary file in the folder as the kernel resolves it."""
    other, roots = tmp_path / "other", tmp_path / "roots"
    (other / "sub").mkdir(parents=True)
    roots.mkdir()
    os.symlink(other / "sub", roots / "L")
    out = install_hooks(f"{roots}/L/../hooks", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")
    assert sorted(p.name for p in (other / "hooks").iterdir()) == sorted(HOOKS)
    assert not (roots / "hooks").exists()
    assert all(os.path.samefile(path, other / "hooks" / name) for name, path in out.items())
    assert stat.S_IMODE(os.stat(other / "hooks" / "slurm-mig-prolog").st_mode) == 0o755
    install_hooks(f"{roots}/L/../hooks", "/usr/bin/python3", "/etc/slurm-mig/slurm-mig.toml")  # again: replaced
    assert sorted(p.name for p in (other / "hooks").iterdir()) == sorted(HOOKS)
