"""scripts/run_tests.py (`make test`): the Slurm tests beside the others, on a stand-in checkout whose
tests are a few lines each."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _checkout(tmp_path: Path, slurm_test: str, other_test: str) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run_tests.py", root / "scripts")
    (root / "tests" / "slurm").mkdir(parents=True)
    (root / "tests" / "slurm" / "test_s.py").write_text(slurm_test)
    (root / "tests" / "test_o.py").write_text(other_test)
    (root / "pytest.ini").write_text("[pytest]\n")
    return root


def _run(root: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(root / "scripts" / "run_tests.py"), *args], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_both_runs_report_and_a_failure_in_either_fails_the_whole(tmp_path):
    root = _checkout(tmp_path, "def test_s():\n    assert 1 == 2\n", "def test_o():\n    pass\n")
    p = _run(root)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 1, out
    # the other run's result, then the Slurm run's whole output, failure included
    assert out.index("1 passed") < out.index("== tests/slurm ==") < out.index("assert 1 == 2")
    assert "tests/slurm: exit 1; the others: exit 0" in out

    (root / "tests" / "slurm" / "test_s.py").write_text("def test_s():\n    pass\n")
    p = _run(root)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "tests/slurm: exit 0; the others: exit 0" in out, out
    assert out.count("1 passed") == 2


def test_arguments_make_one_plain_run_of_them(tmp_path):
    root = _checkout(tmp_path, "def test_s():\n    assert 0\n", "def test_o():\n    pass\n")
    p = _run(root, "-q", "tests/test_o.py")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "1 passed" in out and "tests/slurm" not in out, out


def test_a_sigterm_reaches_both_runs_and_their_teardown(tmp_path):
    """A CI timeout's SIGTERM to `make test`: both runs must stop, each tearing its fixtures down (what stops the
    daemons the real ones start), and the whole must not exit 0."""
    body = """import pathlib, time, pytest
@pytest.fixture
def held():
    yield
    (pathlib.Path(__file__).parent / "{name}.torn-down").write_text("")
def test_waits(held):
    (pathlib.Path(__file__).parent / "{name}.started").write_text("")
    time.sleep(60)
"""
    conftest = (REPO / "tests" / "conftest.py").read_text()  # the SIGTERM-as-Ctrl-C hook of the real suite
    root = _checkout(tmp_path, body.format(name="s"), body.format(name="o"))
    (root / "tests" / "conftest.py").write_text(conftest)
    p = _run(root)
    started = [root / "tests" / "slurm" / "s.started", root / "tests" / "o.started"]
    deadline = time.monotonic() + 60
    while not all(f.exists() for f in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(f.exists() for f in started)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 30, out  # not the tests' 60 s sleep
    assert p.returncode != 0, out
    assert (root / "tests" / "slurm" / "s.torn-down").exists() and (root / "tests" / "o.torn-down").exists(), out
