"""Findings of the security review (docs/security.md): each test fails without its fix."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from slurm_mig.api.auth import HEADER, AuthError, HmacAuth
from slurm_mig.api.server import ApiServer
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.store import open_store

KEY = b"k" * 64
H100 = [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True}]


class _NoSlurm:
    def job_detail(self, job_id):
        return None

    def scontrol_requeue(self, job_id, **kw):
        pass

    def run(self, argv, **kw):
        return None


def _raw_post(srv, path: str, body: bytes, header: str) -> int:
    host, port = srv.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={HEADER: header})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_a_signed_request_cannot_be_sent_to_another_route(tmp_path):
    """The credential covered the body but not the route: a machine in the middle could take a node's signed
    /v1/bound (sent while the job runs) and deliver it to /v1/bind-failed instead, which released the running
    job's binding in the controller and marked it requeued; the node accepted the signed {"ok": true}."""
    store = open_store(tmp_path / "state.db", busy_timeout_s=0.5)
    ctl = Controller(Config(), store, _NoSlurm())
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), ctl.routes(), ctl.get_routes()).start()
    try:
        now = time.time()
        store.replace_observed("n1", H100, [], now=now)
        store.upsert_job("7", profile="3g.40gb", now=now)
        store.bind("7", "n1", [{"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}], now=now)
        store.set_job_state("7", "RUNNING", node="n1", now=now)
        body = json.dumps({"job_id": "7", "node": "n1", "instances": [
            {"gpu": 0, "profile": "3g.40gb", "start": 0, "uuid": "MIG-a"}], "bound_at": now, "local": False},
            sort_keys=True).encode()
        # What the node signs for /v1/bound (the client's own call), replayed by the middle to another route.
        node = HmacAuth(KEY)
        try:
            header = node.sign(body, "n1", path="/v1/bound")
        except TypeError:  # before the fix: sign() knew no route
            header = node.sign(body, "n1")
        assert _raw_post(srv, "/v1/bind-failed", body, header) == 401
        assert len(store.bound_instances("7")) == 1
        assert store.get_job("7").state == "RUNNING"
        # The same credential on its own route is served (and only once).
        assert _raw_post(srv, "/v1/bound", body, header) == 200
        assert _raw_post(srv, "/v1/bound", body, header) == 401
    finally:
        srv.stop()
        store.close()


def test_the_route_is_part_of_the_hmac_credential():
    auth = HmacAuth(KEY)
    body = b"{}"
    with pytest.raises(AuthError, match="does not match"):
        auth.verify(auth.sign(body, "n1", path="/v1/prolog"), body, path="/v1/bind-failed")
    assert auth.verify(auth.sign(body, "n1", path="/v1/prolog"), body, path="/v1/prolog").host == "n1"


def test_the_route_is_part_of_the_munge_credential(monkeypatch):
    """The same for MUNGE (munged stood in for: it returns the payload it was given, as root)."""
    from slurm_mig.api.auth import MungeAuth

    auth = MungeAuth(use_library=False)
    monkeypatch.setattr(auth, "_encode", lambda payload: "MUNGE:" + payload.hex())
    monkeypatch.setattr(auth, "_decode", lambda cred: (bytes.fromhex(cred[6:]), 0, 0, "10.0.0.1"))
    body = b"{}"
    with pytest.raises(AuthError, match="another route"):
        auth.verify(auth.sign(body, "n1", path="/v1/bound"), body, path="/v1/bind-failed")
    assert auth.verify(auth.sign(body, "n1", path="/v1/bound"), body, path="/v1/bound").uid == 0


def test_node_keys_in_a_folder_others_can_write_or_owned_by_others_are_refused(tmp_path, monkeypatch):
    """The controller checked only each key file's mode: in a node key folder others can write, a user could
    plant <node>.key (0600, theirs) with a key they know, or replace a node's key, and sign as that node.
    The folder must now be the controller's and not writable by others, and a key file the controller's."""
    import os

    from slurm_mig.api.auth import NodeKeys, load_key
    from slurm_mig.api.cli import create_node_keys

    folder = tmp_path / "node-keys"
    create_node_keys(str(folder), ["n1"])
    ctl = HmacAuth(None, node_keys=NodeKeys(str(folder)))
    body = b"{}"
    mine = HmacAuth(load_key(str(folder / "n1.key")))
    assert ctl.verify(mine.sign(body, "n1", path="/v1/report"), body, path="/v1/report").host == "n1"
    # A user's own key, planted in a folder they can write.
    os.chmod(folder, 0o777)
    planted = folder / "n2.key"
    planted.write_text("p" * 64 + "\n")
    os.chmod(planted, 0o600)
    with pytest.raises(AuthError, match="cannot use node n2's key file"):
        ctl.verify(HmacAuth(b"p" * 64).sign(body, "n2", path="/v1/report"), body, path="/v1/report")
    with pytest.raises(AuthError, match="writable by its owner only"):
        NodeKeys(str(folder)).get("n1")
    os.chmod(folder, 0o700)
    assert NodeKeys(str(folder)).get("n2") == b"p" * 64
    # A key file (0600) that belongs to someone else than the controller's user: its owner can rewrite it.
    real_euid = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: real_euid + 1)
    with pytest.raises(AuthError):
        NodeKeys(str(folder)).get("n2")
    with pytest.raises(AuthError, match="owned by uid"):
        load_key(str(planted))


def test_a_root_owned_node_key_folder_is_trusted_by_a_controller_run_as_its_own_user(tmp_path, monkeypatch):
    """root can rewrite anything anyway: a controller run as its own user may keep its keys in root's
    folder (/etc/slurm-mig/node-keys), provided the key files are its own."""
    import os

    from slurm_mig.api.auth import NodeKeys

    if os.geteuid() != 0:
        pytest.skip("needs a root-owned folder")
    folder = tmp_path / "node-keys"
    folder.mkdir(mode=0o700)
    key = folder / "n1.key"
    key.write_text("k" * 64 + "\n")
    os.chmod(key, 0o600)
    os.chown(key, 4242, 4242)
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    assert NodeKeys(str(folder)).get("n1") == b"k" * 64
    os.chmod(folder, 0o770)
    with pytest.raises(AuthError, match="writable by its owner only"):
        NodeKeys(str(folder)).get("n1")


def test_control_characters_in_a_request_path_are_not_logged_raw(caplog):
    """Anyone who can reach the port chose the path the server logged with a refusal, before any
    authentication; http.server keeps ESC in it, so a request could write terminal escapes (clear the
    screen, move the cursor up and erase the lines before it) into the log an admin reads."""
    import logging
    import socket

    seen = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {"/v1/echo": lambda p, who: {"ok": True}},
                    on_error=lambda kind, msg: seen.append(msg)).start()
    try:
        evil = "/v1/echo\x1b[1A\x1b[2K\x1b]0;owned\x07"
        with caplog.at_level(logging.DEBUG, logger="slurm_mig.api"), \
                socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(f"POST {evil} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode("latin-1"))
            assert b" 401 " in sock.recv(4096).split(b"\r\n", 1)[0]
            time.sleep(0.2)
    finally:
        srv.stop()
    logged = [r.getMessage() for r in caplog.records] + seen
    assert any("\\x1b[1A" in m for m in logged), logged
    assert not any(ch in m for m in logged for ch in "\x1b\x07"), logged


def test_a_401_does_not_tell_an_unauthenticated_sender_where_the_keys_are(tmp_path):
    """A request naming a node without a key file was answered (401, to anyone) with the path of the
    controller's key folder."""
    from slurm_mig.api.auth import NodeKeys
    from slurm_mig.api.cli import create_node_keys

    folder = tmp_path / "secret-key-folder"
    create_node_keys(str(folder), ["n1"])
    ctl = HmacAuth(None, node_keys=NodeKeys(str(folder)))
    with pytest.raises(AuthError, match="no key for node 'n9'") as refused:
        ctl.verify(HmacAuth(b"x" * 64).sign(b"{}", "n9", path="/v1/report"), b"{}", path="/v1/report")
    assert "secret-key-folder" not in str(refused.value)


def test_refused_requests_are_logged_once_per_kind_and_address_per_window_and_every_one_counted(tmp_path, caplog):
    """Anyone who can reach the port (every user on every node) can send requests the server refuses: each
    wrote one WARNING line, so a loop of them grew the controller's log by thousands of lines a second.
    Now the first refusal of a kind from an address is logged in full, then at most one line a window with
    the number held back since; every request is still refused and counted in slurm_mig_api_errors_total."""
    import logging
    import socket

    from slurm_mig.api import server as servermod

    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(), store, _NoSlurm())
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), ctl.routes(), ctl.get_routes(),
                    on_error=lambda kind, msg: ctl.metrics.inc("slurm_mig_api_errors_total", (("kind", kind),)))
    clock = [5000.0]
    srv.clock = lambda: clock[0]  # no wall-clock waits: the window is stepped by hand
    srv.start()
    forged = HmacAuth(b"x" * 64)  # a key the controller does not have
    body = json.dumps({"node": "n1", "observed": [], "bindings": {}}).encode()

    def post(source: str = "127.0.0.1") -> int:
        conn = http.client.HTTPConnection(*srv.address, timeout=5, source_address=(source, 0))
        try:
            conn.request("POST", "/v1/report", body=body,
                         headers={HEADER: forged.sign(body, "n1", path="/v1/report")})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def oversized() -> bytes:  # a bad_request: refused before its body is read
        with socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(b"POST /v1/report HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
            return sock.recv(4096).split(b"\r\n", 1)[0]

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "slurm_mig.api" and "request refused" in r.getMessage()]

    caplog.set_level(logging.WARNING, logger="slurm_mig.api")
    try:
        assert [post() for _ in range(30)] == [401] * 30  # every one refused, as before
        assert len(said()) == 1 and said()[0].startswith("request refused (auth): 127.0.0.1 /v1/report: ")
        assert post("127.0.0.2") == 401  # another address gets its own first line
        assert len(said()) == 2 and "127.0.0.2" in said()[1]
        assert b" 413 " in oversized()  # and so does another kind from the same address
        assert len(said()) == 3 and said()[2].startswith("request refused (bad_request): 127.0.0.1 ")
        clock[0] += servermod.REFUSAL_LOG_EVERY_S - 1
        assert post() == 401
        assert len(said()) == 3
        clock[0] += 1  # a window after 127.0.0.1's first auth line: one line, with the count held back
        assert post() == 401
        assert len(said()) == 4 and "30 more auth refusals from 127.0.0.1" in said()[3], said()[3]
        assert post() == 401
        assert len(said()) == 4
    finally:
        srv.stop()
        store.close()
    metrics = ctl.metrics.render().decode()
    assert 'slurm_mig_api_errors_total{kind="auth"} 34' in metrics  # every refusal counted
    assert 'slurm_mig_api_errors_total{kind="bad_request"} 1' in metrics

    # Without an address, refusals are told apart by kind and message; still counted every time.
    seen = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {}, on_error=lambda kind, msg: seen.append(kind))
    srv.clock = lambda: clock[0]
    caplog.clear()
    for _ in range(5):
        srv._error("rejected", "/v1/x: no")
    srv._error("rejected", "/v1/x: other")
    srv.httpd.server_close()
    assert said() == ["request refused (rejected): /v1/x: no", "request refused (rejected): /v1/x: other"]
    assert seen == ["rejected"] * 6


def test_the_refusal_log_limit_remembers_a_bounded_number_of_addresses(monkeypatch, caplog):
    """Addresses past the cap (a flood from many) share one slot: memory stays bounded."""
    import logging

    from slurm_mig.api import server as servermod

    monkeypatch.setattr(servermod, "REFUSAL_LOG_MAX_KEYS", 3)
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {})
    clock = [0.0]
    srv.clock = lambda: clock[0]
    try:
        with caplog.at_level(logging.WARNING, logger="slurm_mig.api"):
            for i in range(50):
                srv._error("auth", f"10.0.0.{i} /v1/report: bad", peer=f"10.0.0.{i}")
            assert len(srv._quiet._last) <= 4  # 3 addresses and the shared slot
            lines = [r.getMessage() for r in caplog.records]
            assert len(lines) == 4  # 3 addresses in full, and the first that did not fit
            clock[0] += servermod.REFUSAL_LOG_EVERY_S
            srv._error("auth", "10.0.0.99 /v1/report: bad", peer="10.0.0.99")
            assert len(srv._quiet._last) <= 3
    finally:
        srv.httpd.server_close()


def test_a_flood_of_refusals_that_stops_is_summed_up_in_a_closing_line(caplog):
    """The count of refusals held back was said only with the next line about them: a flood that stopped had
    none, so the log never said how big it was. Once a whole window passes with none held back, the server
    (between its polls) says how many there were; a flood that goes on is counted in its next line, as before."""
    import logging
    import time as _time

    from slurm_mig.api import server as servermod

    every = servermod.REFUSAL_LOG_EVERY_S
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {})
    clock = [1000.0]
    srv.clock = lambda: clock[0]

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "slurm_mig.api"]

    caplog.set_level(logging.WARNING, logger="slurm_mig.api")
    try:
        for _ in range(25):
            srv._error("auth", "10.0.0.7 /v1/report: bad signature", peer="10.0.0.7")
        srv._error("rejected", "/v1/x: no")
        srv._error("rejected", "/v1/x: no")
        srv._error("busy", "10.0.0.8: over 2048 open connections", peer="10.0.0.8")  # said, none held back
        assert len(said()) == 3
        clock[0] += every - 1
        srv.say_ended()
        assert len(said()) == 3  # the window has not passed: it may go on
        clock[0] += 1
        srv.say_ended()
        assert said()[3:] == [
            f"request refused (auth from 10.0.0.7): 24 more since the last line about them, not logged, and none in "
            f"the last {every:.0f} s; all are counted in slurm_mig_api_errors_total",
            f"request refused (rejected: /v1/x: no): 1 more since the last line about them, not logged, and none in "
            f"the last {every:.0f} s; all are counted in slurm_mig_api_errors_total"]
        srv.say_ended()
        assert len(said()) == 5  # said once
        srv._error("auth", "10.0.0.7 /v1/report: bad signature", peer="10.0.0.7")
        assert said()[5] == "request refused (auth): 10.0.0.7 /v1/report: bad signature"  # a new flood, in full
        # A flood that goes on is counted in its next line and has no closing line meanwhile.
        for _ in range(3):
            clock[0] += every / 2
            srv._error("auth", "10.0.0.7 /v1/report: bad signature", peer="10.0.0.7")
            srv.say_ended()
        assert len(said()) == 7 and "and 1 more auth refusals from 10.0.0.7" in said()[6], said()[6:]
        # The serving thread says it between polls, with no request coming in.
        caplog.clear()
        srv.start()
        clock[0] += every
        deadline = _time.monotonic() + 10
        while not said() and _time.monotonic() < deadline:
            _time.sleep(0.05)
        assert said() and said()[0].startswith("request refused (auth from 10.0.0.7): 1 more since"), said()
    finally:
        if srv._thread is not None:
            srv.stop()
        else:  # (shutdown would wait for a serve_forever never started)
            srv.httpd.server_close()


def test_the_log_limiter_hands_back_floods_that_ended():
    from slurm_mig.api.loglimit import LogLimiter

    q = LogLimiter(60.0, max_keys=2)
    assert q.say("a", 0.0) == 0 and q.say("a", 1.0) is None and q.say("a", 30.0) is None
    assert q.say("b", 0.0) == 0
    assert q.say("c", 5.0) == 0 and q.say("d", 6.0) is None  # c and d: the shared slot
    assert q.ended(60.0) == []  # a: held back 30 s ago; the shared slot 54 s ago
    assert q.ended(66.0) == [("", 1)]
    assert "b" not in q._last  # said 66 s ago, nothing held back: forgotten too
    assert q.ended(89.0) == [] and q.ended(90.0) == [("a", 2)] and q._last == {}
    assert q.say("a", 91.0) == 0  # a new flood: said as a first
