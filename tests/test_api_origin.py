"""[auth].node_origin: a request for node N must be encoded on N's host (MUNGE's ENCODE_HOST against
Slurm's NodeAddr). Unit tests with a fixed resolver, the controller's modes, and real munged daemons
(one of them started with --origin, as on another host) in front of a real ApiServer."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import time

import pytest

from slurm_mig.api.auth import HmacAuth, MungeAuth, Principal
from slurm_mig.api.client import ControllerClient, ControllerRefused
from slurm_mig.api.origin import NodeOrigins, encode_address
from slurm_mig.api.server import ApiServer, RequestForbidden
from slurm_mig.config import AuthConfig, Config
from slurm_mig.controller.service import Controller
from slurm_mig.slurm.localcluster import _pid_alive as _alive  # a zombie counts as gone
from slurm_mig.slurm.parsers import SlurmNode
from slurm_mig.store import open_store

DNS = {"gpu1": {"10.0.0.1"}, "10.0.0.2": {"10.0.0.2"}, "127.0.0.1": {"127.0.0.1"},
       "head": {"192.0.2.2"}, "head.example": {"192.0.2.2", "198.51.100.2"}}
NODES = [SlurmNode(name="n1", state="idle", address="gpu1"), SlurmNode(name="n2", state="idle", address="10.0.0.2"),
         SlurmNode(name="n3", state="idle", address="nowhere"), SlurmNode(name="n4", state="idle"),
         SlurmNode(name="local", state="idle", address="127.0.0.1")]


class Resolver:
    def __init__(self):
        self.asked: list[str] = []

    def __call__(self, name: str) -> frozenset[str]:
        self.asked.append(name)
        return frozenset(DNS.get(name, ()))


def origins(clock=None) -> tuple[NodeOrigins, Resolver]:
    r = Resolver()
    o = NodeOrigins(resolver=r, local_names=("head", "head.example"), clock=clock or (lambda: 0.0))
    o.update(NODES)
    return o, r


@pytest.mark.parametrize("said, addr", [("10.0.0.5", "10.0.0.5"), ("node5 (10.0.0.5)", "10.0.0.5"),
                                        ("??? (192.0.2.77)", "192.0.2.77"), ("", ""), ("node5", ""),
                                        ("999.1.1.1", ""), ("10.0.0.5.6", ""), ("0.0.0.0", "")])
def test_the_encoding_address_is_read_from_either_form_munge_gives(said, addr):
    assert encode_address(said) == addr


def test_a_node_may_speak_for_itself_only_from_its_own_address():
    o, _ = origins()
    assert o.check("n1", "10.0.0.1").ok and o.check("n1", "10.0.0.1").checked
    assert o.check("n2", "n2 (10.0.0.2)").ok
    bad = o.check("n1", "10.0.0.2")  # n2 speaking for n1
    assert not bad.ok and bad.checked and "10.0.0.2" in bad.why and "n1" in bad.why
    assert not o.check("n2", "192.0.2.2").ok  # the head node is not n2 either


def test_nodes_on_this_host_may_send_from_any_of_its_addresses():
    o, _ = origins()
    for sender in ("127.0.0.1", "127.0.1.1", "192.0.2.2", "198.51.100.2"):
        assert o.check("local", sender).ok, sender
    assert not o.check("local", "10.0.0.1").ok  # n1 claiming to be the local node


def test_what_cannot_be_checked_is_served_and_says_why():
    o, _ = origins()
    for node, sender, why in [("n3", "10.0.0.3", "does not resolve"), ("n4", "10.0.0.4", "does not resolve"),
                              ("n9", "10.0.0.9", "not known"), ("n1", "", "no IPv4 origin")]:
        v = o.check(node, sender)
        assert v.ok and not v.checked and why in v.why, (node, v)
        assert v.quiet == (node == "n9")  # before the first tick every node is unknown: not worth a line


def test_addresses_are_resolved_in_update_and_refreshed_after_ten_minutes():
    t = [0.0]
    o, r = origins(lambda: t[0])
    first = list(r.asked)
    assert "gpu1" in first and "n4" in first and "head.example" in first
    o.update(NODES)
    assert r.asked == first  # nothing asked again within refresh_s
    o.update([dataclasses.replace(NODES[0], address="10.0.0.2")])  # n1 moved: its new NodeAddr counts at once
    assert r.asked == first and o.check("n1", "10.0.0.2").ok and not o.check("n1", "10.0.0.1").ok
    t[0] = 601.0
    DNS.pop("gpu1")  # DNS down for gpu1 at the refresh: its last known address still counts
    try:
        o.update(NODES)
    finally:
        DNS["gpu1"] = {"10.0.0.1"}
    assert not o.check("n1", "10.0.0.2").ok and o.check("n1", "10.0.0.1").checked
    assert len(r.asked) == 2 * len(first)
    r.asked.clear()
    assert o.check("n1", "10.0.0.1").ok and r.asked == []  # a request never resolves anything


class QuietSlurm:
    """What the controller asks Slurm in a tick: no jobs, the nodes above."""

    def jobs(self):
        return []

    def reservations(self):
        return []

    def nodes(self):
        return list(NODES)

    def update_node_gres(self, node, counts, **kw):
        return ""

    def run(self, argv, **kw):
        return None


@pytest.fixture
def controller(tmp_path):
    def make(mode: str) -> Controller:
        store = open_store(tmp_path / f"{mode}.db")
        ctl = Controller(Config(auth=AuthConfig(node_origin=mode)), store, QuietSlurm())
        ctl.origins = NodeOrigins(resolver=Resolver(), local_names=("head",))
        ctl.tick()
        return ctl
    return make


def report(ctl: Controller, node: str, principal: Principal) -> dict:
    return ctl.on_report({"node": node, "observed": [], "bindings": {}}, principal)


def munge(host: str) -> Principal:
    return Principal(0, 0, host, "munge")


def test_enforce_refuses_a_node_speaking_for_another(controller):
    ctl = controller("enforce")
    report(ctl, "n1", munge("10.0.0.1"))
    with pytest.raises(RequestForbidden, match="must come from its own host"):
        report(ctl, "n1", munge("n2 (10.0.0.2)"))
    text = ctl.metrics.render().decode()
    assert 'slurm_mig_node_origin_mismatches_total{node="n1"} 1' in text
    assert 'slurm_mig_node_origin_checks_total{result="match"} 1' in text
    assert 'slurm_mig_node_origin_checks_total{result="mismatch"} 1' in text
    report(ctl, "n9", munge("10.0.0.9"))  # unknown to Slurm: cannot be checked, served
    assert 'slurm_mig_node_origin_checks_total{result="unchecked"} 1' in ctl.metrics.render().decode()


def test_warn_serves_counts_and_logs_once_per_node(controller, caplog):
    ctl = controller("warn")
    with caplog.at_level(logging.INFO, logger="slurm_mig.controller"):
        for _ in range(3):
            report(ctl, "n1", munge("10.0.0.2"))
    lines = [r.getMessage() for r in caplog.records if "another host" in r.getMessage()]
    assert len(lines) == 1 and "n1" in lines[0] and "10.0.0.2" in lines[0] and "served" in lines[0]
    assert 'slurm_mig_node_origin_mismatches_total{node="n1"} 3' in ctl.metrics.render().decode()


def test_under_hmac_the_tick_resolves_nothing(tmp_path):
    ctl = Controller(Config(auth=AuthConfig(method="hmac", node_origin="enforce")), open_store(tmp_path / "h.db"),
                     QuietSlurm())
    ctl.origins = NodeOrigins(resolver=(r := Resolver()), local_names=("head",))
    ctl.tick()
    assert r.asked == [] and ctl.origin_mode == "off"  # HMAC credentials say nothing about the host


def test_off_and_hmac_do_not_look(controller):
    report(controller("off"), "n1", munge("10.0.0.2"))
    ctl = controller("enforce")
    report(ctl, "n1", Principal(0, 0, "n1", "hmac"))  # a shared key says nothing about the host
    assert "slurm_mig_node_origin_mismatches_total" not in ctl.metrics.render().decode()


# -- real munged: one as this host, one with --origin as another host, the same key ------------------

def _stop_munged(pids, timeout: float = 5.0) -> None:
    """SIGTERM each daemonized munged and wait until it is gone (init reaps it, a second or so later)."""
    for pid in pids:
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.02)


def _start_munged(tmp_path, daemons):
    """Start one munged per (name, extra args), all with one key; return (sockets, pids). When one does
    not start, the ones started before it are stopped before the test is skipped."""
    if not shutil.which("munged"):
        pytest.skip("munge is not installed (the slurm test cluster installs it)")
    key = tmp_path / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    socks, pids = [], []
    try:
        for name, extra in daemons:
            sock = str(tmp_path / f"{name}.socket")
            proc = subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                                   f"--pid-file={tmp_path}/{name}.pid", f"--log-file={tmp_path}/{name}.log",
                                   f"--seed-file={tmp_path}/{name}.seed", *extra], capture_output=True)
            if proc.returncode != 0:
                pytest.skip(f"cannot start a private munged: {proc.stderr.decode()}")
            socks.append(sock)
            pids.append(int((tmp_path / f"{name}.pid").read_text()))
    except BaseException:
        _stop_munged(pids)
        raise
    return socks, pids


@pytest.fixture
def two_munged(tmp_path):
    socks, pids = _start_munged(tmp_path, (("here", []), ("other", ["--origin=192.0.2.77"])))
    try:
        yield socks
    finally:
        _stop_munged(pids)


def test_a_munged_that_does_not_start_stops_the_one_before_it(tmp_path):
    """The second munged failing skipped the test and left the first one running for good."""
    if not shutil.which("munged"):
        pytest.skip("munge is not installed (the slurm test cluster installs it)")
    with pytest.raises(pytest.skip.Exception, match="cannot start a private munged"):
        _start_munged(tmp_path, (("here", []), ("other", ["--no-such-option"])))
    left = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if str(tmp_path).encode() in fh.read() and _alive(int(entry)):
                    left.append(int(entry))
        except (OSError, ValueError):
            continue
    assert not left, f"munged {left} still running"


def test_real_munge_origins_through_the_api(two_munged, tmp_path):
    here, other = two_munged
    store = open_store(tmp_path / "state.db")
    nodes = [SlurmNode(name="n1", state="idle", address="127.0.0.1"),
             SlurmNode(name="far", state="idle", address="192.0.2.77")]
    slurm = QuietSlurm()
    slurm.nodes = lambda: list(nodes)
    ctl = Controller(Config(auth=AuthConfig(node_origin="enforce")), store, slurm)
    ctl.tick()
    uid = (os.getuid(),)
    srv = ApiServer("127.0.0.1", 0, MungeAuth(here, allowed_uids=uid), ctl.routes(), ctl.get_routes()).start()
    try:
        url = "http://%s:%d" % srv.address

        def call(sock: str, node: str) -> dict:
            client = ControllerClient(url, MungeAuth(sock, allowed_uids=uid), node, timeout_s=5)
            return client.call("/v1/report", {"node": node, "observed": [], "bindings": {}})

        assert "desired" in call(here, "n1")  # the local node, from this host's munged
        assert "desired" in call(other, "far")  # the far node, from its own address
        with pytest.raises(ControllerRefused) as refused:
            call(other, "n1")  # the far host speaking for the local node
        assert refused.value.status == 403 and "192.0.2.77" in str(refused.value)
        with pytest.raises(ControllerRefused):
            call(here, "far")  # and this host speaking for the far one
    finally:
        srv.stop()
        store.close()
    assert 'slurm_mig_node_origin_mismatches_total{node="n1"} 1' in ctl.metrics.render().decode()


def test_hmac_channel_is_untouched_by_the_origin_check(tmp_path):
    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(auth=AuthConfig(node_origin="enforce")), store, QuietSlurm())
    ctl.tick()
    key = b"k" * 64
    srv = ApiServer("127.0.0.1", 0, HmacAuth(key), ctl.routes(), ctl.get_routes()).start()
    try:
        client = ControllerClient("http://%s:%d" % srv.address, HmacAuth(key), "n1", timeout_s=5)
        assert "desired" in client.call("/v1/report", {"node": "n1", "observed": [], "bindings": {}})
    finally:
        srv.stop()
        store.close()


def test_slow_dns_is_spread_over_ticks_not_spent_in_one():
    class Slow(Resolver):
        def __call__(self, name):
            time.sleep(0.05)
            return super().__call__(name)

    r = Slow()
    o = NodeOrigins(resolver=r, local_names=(), budget_s=0.07, clock=lambda: 0.0)
    o.update(NODES)
    assert 1 <= len(r.asked) <= 3  # the budget ran out after two or so
    waiting = next(n for n in NODES if (n.address or n.name) not in r.asked)
    v = o.check(waiting.name, "10.0.0.99")
    assert v.ok and not v.checked and v.quiet  # not resolved yet: served, not worth a line
    for _ in range(5):
        o.update(NODES)
    assert sorted(set(r.asked)) == sorted({n.address or n.name for n in NODES})
    assert not o.check("local", "10.0.0.1").ok
