"""The node's binding files on a real file system: who can read and change them, and what root hooks trust.

Run as root these use a real second user (nobody, through setpriv) for what a job's user can do.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from slurm_mig.node.localstate import BoundInstance, NodeState

NOBODY = pwd.getpwnam("nobody")
as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                             reason="needs root and setpriv to act as another user")


def _as_nobody(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
                           sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=60)


@pytest.fixture
def state():
    # Not under pytest's tmp_path (0700 root): the job's user must reach the node folder, as under /var/lib.
    folder = tempfile.mkdtemp(prefix="slurm-mig-node-")
    os.chmod(folder, 0o755)
    try:
        yield NodeState(Path(folder) / "n1").ensure()
    finally:
        shutil.rmtree(folder)


MINE = [BoundInstance(0, "3g.40gb", 0, "MIG-aaa")]


@as_root
def test_the_jobs_user_can_read_its_copy_but_change_nothing_root_trusts(state):
    state.write_binding("100", MINE, uid=NOBODY.pw_uid, gid=NOBODY.pw_gid, attempt=0)
    state.write_binding("200", [BoundInstance(0, "2g.20gb", 4, "MIG-bbb")], uid=0, gid=0, attempt=0)
    copy, record = state.root / "bindings" / "100.json", state.root / "records" / "100.json"
    evil = json.dumps({"job_id": "100", "attempt": -5, "instances": [
        {"gpu": 0, "profile": "2g.20gb", "start": 4, "uuid": "MIG-bbb"}]})
    attempts = {
        "read": f"print(open({str(copy)!r}).read())",
        "chmod": f"import os; os.chmod({str(copy)!r}, 0o600)",
        "rewrite": f"open({str(copy)!r}, 'w').write({evil!r})",
        "replace": f"import os; open({str(copy) + '.x'!r}, 'w').write({evil!r}); "
                   f"os.replace({str(copy) + '.x'!r}, {str(copy)!r})",
        "record": f"open({str(record)!r}, 'w').write({evil!r})",
    }
    done = {what: _as_nobody(code) for what, code in attempts.items()}
    assert done["read"].returncode == 0 and "MIG-aaa" in done["read"].stdout, done["read"].stderr
    for what in ("chmod", "rewrite", "replace", "record"):
        assert done[what].returncode != 0 and "PermissionError" in done[what].stderr, (what, done[what])
    assert state.all_bindings() == {"100": MINE, "200": [BoundInstance(0, "2g.20gb", 4, "MIG-bbb")]}
    assert state.binding_attempt("100") == 0
    assert os.stat(copy)[4:6] == (0, NOBODY.pw_gid) and stat.S_IMODE(os.stat(copy).st_mode) == 0o440
    assert os.stat(record)[4:6] == (0, 0) and stat.S_IMODE(os.stat(record).st_mode) == 0o600


def test_root_hooks_read_the_record_never_the_taskprologs_copy(state):
    state.write_binding("100", MINE, gid=os.getegid(), attempt=1)
    copy = state.bindings_dir / "100.json"
    copy.chmod(0o600)
    copy.write_text(json.dumps({"instances": [{"gpu": 0, "profile": "7g.80gb", "start": 0, "uuid": "MIG-x"}],
                                "attempt": 0}))
    assert state.read_binding("100") == MINE and state.all_bindings() == {"100": MINE}
    assert state.bound_slots() == {0: {("3g.40gb", 0)}} and state.binding_attempt("100") == 1
    assert state.read_task_binding("100")[0].uuid == "MIG-x"  # what the TaskProlog alone reads
    state.remove_binding("100")
    assert not copy.exists() and state.read_binding("100") is None


def test_an_oversized_record_is_refused_unread_with_a_log_line(state, caplog):
    state.write_binding("100", MINE)
    big = json.dumps({"instances": [m.to_json() for m in MINE] * 2000}).encode()
    assert len(big) > 64 * 1024
    (state.records_dir / "100.json").write_bytes(big)
    with caplog.at_level(logging.ERROR):
        assert state.all_bindings() == {"100": []}
    assert any("larger than 65536 bytes" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="larger than"):
        state.read_binding("100")


def test_strict_reading_refuses_what_it_cannot_read_and_the_hooks_reading_is_unchanged(tmp_path, caplog):
    """`nvml apply` has no controller to know what a damaged record's job holds: strict reading raises
    where the hooks count the job as bound to nothing known. A node with no records has no bindings."""
    from slurm_mig.errors import BindingsUnreadable

    assert NodeState(tmp_path / "none").all_bindings(strict=True) == {}
    state = NodeState(tmp_path / "n1").ensure()
    state.write_binding("100", MINE)
    assert state.all_bindings(strict=True) == {"100": MINE}
    (state.records_dir / "101.json").write_text("{torn")
    with caplog.at_level(logging.ERROR):
        assert state.all_bindings() == {"100": MINE, "101": []}
    with pytest.raises(BindingsUnreadable, match="job 101"):
        state.all_bindings(strict=True)
    (state.records_dir / "101.json").unlink()
    (state.records_dir / "102.json").mkdir()
    with pytest.raises(BindingsUnreadable, match="job 102"):
        state.all_bindings(strict=True)
    shutil.rmtree(state.records_dir)
    state.records_dir.write_text("")  # a folder that cannot be listed (glob says "nothing" of it)
    assert state.all_bindings() == {}
    with pytest.raises(BindingsUnreadable, match="cannot list"):
        state.all_bindings(strict=True)


def _legacy(state, job_id: str, data: bytes, uid: int, gid: int) -> None:
    """A binding file as slurm-mig wrote it before records/: owned by the job's user, 0400, no record."""
    path = state.bindings_dir / f"{job_id}.json"
    path.write_bytes(data)
    os.chown(path, uid, gid)
    path.chmod(0o400)


def test_bindings_an_older_version_left_are_adopted_on_upgrade(tmp_path, caplog):
    """A node upgraded with jobs running: their user-owned binding files become records (root hooks see
    the jobs bound, the Epilog finds the instances) and copies the user can no longer change."""
    root = tmp_path / "n1"
    (root / "bindings").mkdir(parents=True)
    old = NodeState(root)
    doc = {"job_id": "100", "bound_at": 1.0, "instances": [m.to_json() for m in MINE], "attempt": 2}
    uid, gid = (NOBODY.pw_uid, NOBODY.pw_gid) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    _legacy(old, "100", json.dumps(doc).encode(), uid, gid)
    _legacy(old, "101", b"\xff garbage", uid, gid)
    with caplog.at_level(logging.WARNING):
        state = NodeState(root).ensure()
    assert state.all_bindings() == {"100": MINE, "101": []}  # the damaged one still counts as bound
    assert state.read_binding("100") == MINE and state.binding_attempt("100") == 2
    assert state.read_task_binding("100") == MINE
    with pytest.raises(ValueError):
        state.read_binding("101")
    copy = root / "bindings" / "100.json"
    assert stat.S_IMODE(os.stat(copy).st_mode) == 0o440 and os.stat(copy).st_gid == gid
    if os.geteuid() == 0:
        assert os.stat(copy).st_uid == 0 and os.stat(root / "records" / "100.json")[4:6] == (0, 0)
    assert any("adopted the binding of job 100" in r.getMessage() for r in caplog.records)
    state.ensure()  # adopting is done once: a second pass changes nothing
    assert state.all_bindings() == {"100": MINE, "101": []}


@pytest.mark.parametrize("job_id", ["../x", "1/../../2", "12.json", "", "1" * 33, "12 3", "-1"])
def test_a_job_id_that_is_not_slurms_names_no_file(state, job_id):
    """Job ids become file names under the root-only folders: anything but digits and '_' (array jobs),
    up to 32 characters, is refused before a path is built from it."""
    for act in (lambda: state.write_binding(job_id, MINE), lambda: state.read_binding(job_id),
                lambda: state.remove_binding(job_id), lambda: state.note_attempt(job_id, 0)):
        with pytest.raises(ValueError, match="bad Slurm job id"):
            act()
    state.write_binding("12_3", MINE)  # an array task
    assert state.read_binding("12_3") == MINE


class _Killed(BaseException):
    """The hook killed (SIGKILL, a timeout) at that point: nothing after it runs."""


@as_root
def test_a_hook_killed_while_it_makes_the_cache_folder_leaves_it_traversable(monkeypatch):
    """Found in review. ensure_root made each missing folder 0700 and gave it its mode (cache_dir 0755) in a
    second call: a hook killed in between (the first hook on a fresh node, killed at its timeout) left
    cache_dir 0700 for good, since a folder that exists is never changed again, and every job's TaskProlog,
    running as the job's user, could not reach its binding copy: every MIG job on the node ran with no GPU.
    The folder is now made with its mode (the umask may only take bits away; the chmod after still undoes a
    strict one)."""
    folder = tempfile.mkdtemp(prefix="slurm-mig-node-")
    os.chmod(folder, 0o755)
    old_umask = os.umask(0o022)
    try:
        state = NodeState(Path(folder) / "cache" / "n1")

        def killed(*args, **kw):
            raise _Killed()

        with monkeypatch.context() as mp:
            mp.setattr(os, "chmod", killed)
            with pytest.raises(_Killed):
                state.ensure()
        state.ensure()
        state.write_binding("100", MINE, uid=NOBODY.pw_uid, gid=NOBODY.pw_gid, attempt=0)
        done = _as_nobody(f"print(open({str(state.bindings_dir / '100.json')!r}).read())")
        assert done.returncode == 0 and "MIG-aaa" in done.stdout, done.stderr
        assert not stat.S_IMODE((Path(folder) / "cache").stat().st_mode) & 0o022
    finally:
        os.umask(old_umask)
        shutil.rmtree(folder)


def test_a_bounded_wait_for_the_layout_lock_gives_up_and_takes_it_soon_after_it_is_let_go(tmp_path, monkeypatch):
    """layout_lock(timeout_s) polls (flock has no time limit): it raises LayoutLockBusy once the time is up,
    and takes the lock within a poll (50 ms at most) once the holder lets it go; free, it takes it at once.
    Told by the pauses it makes (time.sleep), not by a clock: a loaded machine stretches every wait."""
    import threading

    from slurm_mig.node import localstate
    from slurm_mig.node.localstate import LOCK_POLL_FIRST_S, LOCK_POLL_MAX_S, LayoutLockBusy

    pauses = []
    real_sleep = localstate.time.sleep
    monkeypatch.setattr(localstate.time, "sleep", lambda s: pauses.append(s) or real_sleep(s))
    state = NodeState(tmp_path / "n1").ensure()
    with state.layout_lock(0.5):
        assert pauses == []  # free: taken at once
        with pytest.raises(LayoutLockBusy, match="stayed held by another process for 0.2 s"):
            with state.layout_lock(0.2):
                pass  # pragma: no cover - never taken
        assert pauses and pauses[0] == LOCK_POLL_FIRST_S and max(pauses) <= LOCK_POLL_MAX_S
        pauses.clear()
        with pytest.raises(LayoutLockBusy):
            with state.layout_lock(0):
                pass  # pragma: no cover
        assert pauses == []  # 0: one try, no wait
    held, go = threading.Event(), threading.Event()

    def hold():
        with state.layout_lock():
            held.set()
            go.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(5)
    threading.Timer(0.3, go.set).start()
    with state.layout_lock(5.0):
        pass
    holder.join()
    assert max(pauses) <= LOCK_POLL_MAX_S  # so taken at most one poll after it was let go


def test_ensure_never_makes_a_folder_wider_than_its_mode_even_for_a_moment(tmp_path):
    """ensure made records/, bindings/, outbox/ and attempts/ with Path.mkdir (0777 less the umask) and chmod-ed
    them after: under umask 0, records/ (what root hooks trust) was writable by anyone until the chmod, and a
    file put there in that moment stayed a record. Each folder is now made with its mode (never wider), told
    by the modes os.mkdir and os.chmod were given (audit events), not by the modes at the end."""
    from tests.helpers import modes_given, wider_than_final

    old = os.umask(0)
    try:
        with modes_given() as seen:
            state = NodeState(tmp_path / "cache" / "n1").ensure()
    finally:
        os.umask(old)
    made = {p for e, p, _ in seen if e == "os.mkdir"}
    assert {str(d) for d in (state.root, state.records_dir, state.bindings_dir, state.outbox_dir,
                             state.attempts_dir)} <= made, seen
    assert wider_than_final(seen, 0) == []
    assert {d.name: stat.S_IMODE(d.stat().st_mode) for d in state.root.iterdir() if d.is_dir()} == \
        {"records": 0o700, "bindings": 0o711, "outbox": 0o700, "attempts": 0o700}


def test_named_by_others_names_instances_by_uuid_and_by_slot_and_says_which_records_cannot_be_read(state):
    """The one guard of every step that clears a job's "job N" marks (NodeState.named_by_others): the simulated
    GPU keeps its marks by slot, so an instance counts as named by another record by its UUID or by its slot
    (GPU, profile, start); a record that cannot be read is said, as it may name anything."""
    state.write_binding("100", MINE)
    state.write_binding("101", [BoundInstance(1, "1g.10gb", 6, "MIG-bbb")])
    (state.records_dir / "100.earlier-1.json").write_text(
        json.dumps({"instances": [BoundInstance(0, "2g.20gb", 4, "MIG-ccc").to_json()]}))
    (state.records_dir / "102.json").write_bytes(b"{")
    named = state.named_by_others("100")
    assert BoundInstance(0, "3g.40gb", 0, "MIG-aaa") not in named  # only 100 itself names it
    assert BoundInstance(1, "1g.10gb", 6, "MIG-new") in named  # 101's slot, an instance made again since
    assert BoundInstance(0, "2g.20gb", 4, "MIG-ccc") in named and BoundInstance(0, "1g.10gb", 0, "MIG-bbb") in named
    assert BoundInstance(0, "2g.20gb", 0, "MIG-zzz") not in named
    assert named.unreadable == {"102"}
    assert BoundInstance(0, "3g.40gb", 0, "MIG-new") in state.named_by_others("100.earlier-1")
