"""run_slurm / SlurmClient behaviour that needs no Slurm (fake binaries on PATH)."""

from __future__ import annotations

import os
import stat

import pytest

from slurm_mig.errors import SlurmCommandError
from slurm_mig.slurm import runner


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    """Put executable scripts named like Slurm commands first on PATH."""
    def make(name: str, body: str):
        path = tmp_path / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
        return path
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return make


def test_argv_only():
    with pytest.raises(TypeError):
        runner.run_slurm("squeue --json")


def test_result_fields_and_env(fake_bin):
    fake_bin("squeue", 'echo "conf=$SLURM_CONF fmt=${SQUEUE_FORMAT:-unset} args=$*"; echo warn >&2; exit 3\n')
    res = runner.run_slurm(["squeue", "-h"], slurm_conf="/x/slurm.conf", env={"SQUEUE_FORMAT": "%i"})
    assert res.returncode == 3 and not res.ok and not res.timed_out
    assert res.stdout.strip() == "conf=/x/slurm.conf fmt=unset args=-h"  # user formats never leak in
    assert res.stderr.strip() == "warn" and res.duration >= 0
    with pytest.raises(SlurmCommandError) as exc:
        res.check()
    assert exc.value.returncode == 3 and exc.value.stderr.strip() == "warn" and "exit 3" in str(exc.value)
    assert runner.query_slurm(["squeue"]) is None


def test_missing_binary_and_timeout(fake_bin):
    res = runner.run_slurm(["no-such-slurm-command"])
    assert res.returncode == 127 and "not found" in res.stderr
    fake_bin("sinfo", "sleep 5\n")
    res = runner.run_slurm(["sinfo"], timeout=0.3)
    assert res.timed_out and res.returncode == 124 and not res.ok
    with pytest.raises(SlurmCommandError, match="timed out"):
        runner.check_slurm(["sinfo"], timeout=0.3)


def test_input_is_fed(fake_bin):
    fake_bin("sbatch", 'cat > /dev/null; echo "4242;cluster"\n')
    client = runner.SlurmClient(slurm_conf="/x")
    assert client.sbatch(script_text="#!/bin/sh\ntrue\n") == 4242
    with pytest.raises(ValueError):
        client.sbatch()


def test_json_errors_make_queries_none(fake_bin):
    fake_bin("squeue", """echo '{"errors":[{"error":"Unspecified error","errno":-1}],"jobs":[]}'\n""")
    fake_bin("sinfo", "echo 'not json'\n")
    client = runner.SlurmClient()
    assert client.squeue_json() is None and client.jobs() is None
    assert client.nodes() is None


@pytest.mark.parametrize("printed", ['{"meta": {}}', '{"jobs": null, "nodes": null}', "null", "[]", '"jobs"',
                                     '{"jobs": {}, "nodes": 3}'])
def test_json_without_its_list_is_stale_data_not_an_empty_queue(fake_bin, printed):
    """Read as "no jobs", a document without its list would cancel every pending job in the store; one
    that is not an object raised AttributeError inside the tick (found in review)."""
    fake_bin("squeue", f"echo '{printed}'\n")
    fake_bin("sinfo", f"echo '{printed}'\n")
    client = runner.SlurmClient()
    assert client.jobs() is None and client.nodes() is None


def test_entries_that_are_not_objects_are_skipped(fake_bin):
    fake_bin("squeue", """echo '{"jobs": [7, null, {"job_id": 12, "job_state": "PENDING"}]}'\n""")
    fake_bin("sinfo", """echo '{"nodes": ["n1", {"name": "n2", "state": "idle"}]}'\n""")
    client = runner.SlurmClient()
    assert [j.job_id for j in client.jobs()] == [12]
    assert [n.name for n in client.nodes()] == ["n2"]
    fake_bin("squeue", """echo '{"jobs": []}'\n""")
    assert client.jobs() == []  # an empty list is an empty queue


def test_update_node_gres_argv(fake_bin, tmp_path):
    log = tmp_path / "argv.log"
    fake_bin("scontrol", f"""
if [ "$1" = show ]; then
  echo 'NodeName=n1 Arch=x86_64'
  echo '   Gres=mig:1g:4(S:0),gpu:a100:1(S:0)'
  exit 0
fi
printf '%s\\n' "$@" > {log}
""")
    value = runner.SlurmClient().update_node_gres("n1", {"3g": 2})
    assert value == "mig:1g:0,mig:1gme:0,mig:1gdm:0,mig:2g:0,mig:2gme:0,mig:3g:2,mig:4g:0,mig:7g:0,gpu:a100:1"
    assert log.read_text().split("\n")[:3] == ["update", "NodeName=n1", f"Gres={value}"]


def test_from_config():
    from slurm_mig.config import Config

    client = runner.SlurmClient.from_config(Config())
    assert client.slurm_conf == Config().controller.slurm_conf
    assert client.timeout == Config().slurm.command_timeout_s


def test_one_process_runs_at_most_max_concurrent_slurm_commands(monkeypatch):
    """Every Prolog of a job no tick has seen asks scontrol from its own request thread: a burst (or one
    node sending many) forked as many commands on the head node at once. Now MAX_CONCURRENT run; the rest
    wait for a slot within their timeout, and one that waits too long fails as a timeout."""
    import subprocess
    import threading

    from tests.helpers import MostAtOnce

    probe = MostAtOnce()
    ran = probe.wrap(lambda argv, **kw: subprocess.CompletedProcess(argv, 0, "ok", ""))
    monkeypatch.setattr(runner.subprocess, "run", ran)
    results = []
    threads = [threading.Thread(target=lambda: results.append(runner.run_slurm(["scontrol", "show", "job", "1"])))
               for _ in range(4 * runner.MAX_CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert probe.most == runner.MAX_CONCURRENT
    assert len(results) == 4 * runner.MAX_CONCURRENT and all(r.ok for r in results)
    # Every slot held: a command that cannot get one within its timeout is a timed-out result.
    for _ in range(runner.MAX_CONCURRENT):
        runner._SLOTS.acquire()
    try:
        res = runner.run_slurm(["sinfo"], timeout=0.2)
        assert res.timed_out and not res.ok and "already running" in res.stderr
    finally:
        for _ in range(runner.MAX_CONCURRENT):
            runner._SLOTS.release()


def test_a_command_without_timeout_waits_for_a_slot(monkeypatch):
    """timeout=None means no limit: with every slot held it waits for one, it is not refused at once as
    'not run' (Semaphore.acquire(timeout=-1) does not block: it returns False when no slot is free)."""
    import subprocess
    import threading
    import time

    monkeypatch.setattr(runner.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 0, "ok", ""))
    for _ in range(runner.MAX_CONCURRENT):
        runner._SLOTS.acquire()
    released = [False]

    def free_one():
        time.sleep(0.3)
        released[0] = True
        runner._SLOTS.release()

    t = threading.Thread(target=free_one)
    t.start()
    try:
        res = runner.run_slurm(["sinfo"], timeout=None)
    finally:
        t.join()
        for _ in range(runner.MAX_CONCURRENT - 1):
            runner._SLOTS.release()
    assert released[0] and res.ok and not res.timed_out
