"""[auth].hmac_node_keys_dir: one HMAC key per node, so that a node can sign only for itself.
Real key files, a real Controller behind a real ApiServer, the real ControllerClient."""

from __future__ import annotations

import http.client
import json
import os
import stat

import pytest

from slurm_mig.api.auth import HEADER, AuthError, HmacAuth, NodeKeys, auth_from_settings, create_key, load_key
from slurm_mig.api.cli import create_node_keys
from slurm_mig.api.client import ControllerClient, ControllerRefused, ControllerUnavailable
from slurm_mig.api.server import ApiServer
from slurm_mig.cli import main
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.errors import SlurmMigError
from slurm_mig.store import open_store


@pytest.fixture
def keys(tmp_path):
    folder = tmp_path / "node-keys"
    create_node_keys(str(folder), ["n1", "n2"])
    return folder


def node_auth(folder, node: str) -> HmacAuth:
    """What a node has: its own key, nothing else."""
    return HmacAuth(load_key(str(folder / f"{node}.key")))


def test_keys_are_created_once_0600_in_a_0700_folder(tmp_path):
    folder = tmp_path / "k"
    got = create_node_keys(str(folder), ["gpu01", "gpu02", "gpu01"])
    assert [(n, c) for n, _p, c in got] == [("gpu01", True), ("gpu02", True)]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((folder / f"{n}.key").stat().st_mode) == 0o600 for n in ("gpu01", "gpu02"))
    before = (folder / "gpu01.key").read_bytes()
    assert [c for _n, _p, c in create_node_keys(str(folder), ["gpu01", "gpu03"])] == [False, True]
    assert (folder / "gpu01.key").read_bytes() == before  # never overwritten
    assert load_key(str(folder / "gpu01.key")) != load_key(str(folder / "gpu02.key"))


@pytest.mark.parametrize("bad", ["../etc/passwd", ".hidden", "a/b", "", "x" * 65, "a..b", "n1 n2"])
def test_a_name_that_is_not_a_node_names_no_key_file(tmp_path, bad):
    with pytest.raises(SlurmMigError, match="not a node name"):
        create_node_keys(str(tmp_path / "k"), ["n1", bad])
    assert not (tmp_path / "k").exists()  # refused before anything was written
    assert NodeKeys(str(tmp_path)).get(bad) is None


def test_unsafe_folders_and_key_files_are_refused(tmp_path):
    folder = tmp_path / "k"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    with pytest.raises(SlurmMigError, match="must be 0700"):
        create_node_keys(str(folder), ["n1"])
    os.chmod(folder, 0o700)
    create_node_keys(str(folder), ["n1"])
    n1 = HmacAuth(load_key(str(folder / "n1.key")))
    os.chmod(folder / "n1.key", 0o644)
    with pytest.raises(AuthError, match="must be 0600"):
        NodeKeys(str(folder)).get("n1")
    body = b"{}"
    signed = n1.sign(body, "n1")
    with pytest.raises(AuthError) as refused:  # the sender is told nothing about paths or modes
        HmacAuth(None, node_keys=NodeKeys(str(folder))).verify(signed, body)
    assert "n1" in str(refused.value) and str(folder) not in str(refused.value) and "0600" not in str(refused.value)
    with pytest.raises(SlurmMigError, match="0600"):
        create_node_keys(str(folder), ["n1"])  # an existing key is checked, not silently kept


def test_a_node_signs_for_itself_only(keys):
    ctl = HmacAuth(None, node_keys=NodeKeys(str(keys)))
    body = b'{"node": "n1"}'
    assert ctl.verify(node_auth(keys, "n1").sign(body, "n1"), body).host == "n1"
    with pytest.raises(AuthError, match="does not match"):
        ctl.verify(node_auth(keys, "n1").sign(body, "n2"), body)  # n1's key, claiming to be n2
    with pytest.raises(AuthError, match="no key for node 'n3'"):
        ctl.verify(HmacAuth(b"s" * 64).sign(body, "n3"), body)  # no key file, no shared key


def test_the_shared_key_covers_only_nodes_without_a_key_file(keys):
    shared = b"s" * 64
    ctl = HmacAuth(shared, node_keys=NodeKeys(str(keys)))
    body = b"{}"
    assert ctl.verify(HmacAuth(shared).sign(body, "n3"), body).host == "n3"  # not rolled out yet
    with pytest.raises(AuthError):
        ctl.verify(HmacAuth(shared).sign(body, "n1"), body)  # n1 has its own key now: the shared one is out


@pytest.mark.parametrize("name", ["", ".n1", "n1\n", "a" * 65])
def test_a_credential_must_name_a_node(keys, tmp_path, name):
    """A holder of the shared key (a node not rolled out yet) who signs with an empty or odd node name
    would fall back to the shared key and name no node to hold it to: refused with 401, nothing stored."""
    shared = b"s" * 64
    ctl_auth = HmacAuth(shared, node_keys=NodeKeys(str(keys)))
    body = json.dumps({"node": "n1", "observed": [], "bindings": {}}).encode()
    with pytest.raises(AuthError, match="names no valid node"):
        ctl_auth.verify(HmacAuth(shared).sign(body, name), body)
    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(), store, NoSlurm())
    srv = ApiServer("127.0.0.1", 0, ctl_auth, ctl.routes(), ctl.get_routes()).start()
    try:
        conn = http.client.HTTPConnection(*srv.address, timeout=5)
        conn.request("POST", "/v1/report", body=body, headers={HEADER: HmacAuth(shared).sign(body, name, path="/v1/report")})
        assert conn.getresponse().status == 401
        conn.close()
    finally:
        srv.stop()
    assert store.node("n1") is None
    store.close()


def test_answers_are_signed_with_the_asking_nodes_key(keys):
    ctl = HmacAuth(None, node_keys=NodeKeys(str(keys)))
    body, answer = b"{}", b'{"ok": true}'
    request = node_auth(keys, "n1").sign(body, "n1")
    signed = ctl.sign_response(request, 200, answer)
    node_auth(keys, "n1").verify_response(request, 200, signed, answer)
    with pytest.raises(AuthError):
        node_auth(keys, "n2").verify_response(request, 200, signed, answer)


def test_a_rotated_key_takes_effect_without_a_restart(keys):
    ctl = HmacAuth(None, node_keys=NodeKeys(str(keys)))
    old = node_auth(keys, "n1")
    body = b"{}"
    ctl.verify(old.sign(body, "n1"), body)
    (keys / "n1.key").unlink()
    create_key(str(keys / "n1.key"))
    with pytest.raises(AuthError):
        ctl.verify(old.sign(body, "n1"), body)
    assert ctl.verify(node_auth(keys, "n1").sign(body, "n1"), body).host == "n1"


def test_the_controller_config_builds_it_and_says_what_is_missing(tmp_path, keys):
    a = auth_from_settings("hmac", key_file=str(tmp_path / "absent.key"), node_keys_dir=str(keys))
    assert a.key is None and a.node_keys.folder == str(keys)
    with pytest.raises(AuthError, match="does not exist"):
        auth_from_settings("hmac", key_file="", node_keys_dir=str(tmp_path / "nope"))


class NoSlurm:
    def jobs(self):
        return []

    def reservations(self):
        return []

    def nodes(self):
        return []

    def update_node_gres(self, node, counts, **kw):
        return ""

    def run(self, argv, **kw):
        return None


def test_through_the_api_a_node_cannot_speak_for_another(keys, tmp_path):
    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(), store, NoSlurm())
    srv = ApiServer("127.0.0.1", 0, HmacAuth(None, node_keys=NodeKeys(str(keys))), ctl.routes(),
                    ctl.get_routes()).start()
    url = "http://%s:%d" % srv.address
    try:
        def report(key_of: str, signs_as: str, about: str) -> dict:
            client = ControllerClient(url, node_auth(keys, key_of), signs_as, timeout_s=5)
            return client.call("/v1/report", {"node": about, "observed": [], "bindings": {}})

        assert "desired" in report("n1", "n1", "n1")
        assert "desired" in report("n2", "n2", "n2")
        with pytest.raises(ControllerRefused) as e:
            report("n1", "n1", "n2")  # signed as itself, about another node
        assert e.value.status == 403 and "cannot speak for node n2" in str(e.value)
        with pytest.raises(ControllerUnavailable):
            report("n1", "n2", "n2")  # claims n2's name: 401, and the answer cannot be verified
    finally:
        srv.stop()
        store.close()
    assert 'slurm_mig_node_origin_mismatches_total{node="n2"} 1' in ctl.metrics.render().decode()


def test_keys_command(tmp_path, capsys):
    assert main(["keys", "--dir", str(tmp_path / "k"), "gpu[01-03]", "head"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in out] == ["gpu01", "gpu02", "gpu03", "head"]
    assert all(line.endswith("created") for line in out)
    assert main(["keys", "--dir", str(tmp_path / "k"), "gpu01"]) == 0
    assert capsys.readouterr().out.strip().endswith("kept")
    assert main(["keys", "--dir", str(tmp_path / "k"), "../x"]) != 0
    assert "not a node name" in capsys.readouterr().err


@pytest.mark.parametrize("under", ["a-file", "a-file/keys"])
def test_keys_into_a_folder_that_cannot_be_made_is_an_error(tmp_path, capsys, under):
    """`slurm-mig keys --dir <a file> n1` printed os.makedirs' FileExistsError (NotADirectoryError below it)
    traceback. Found giving keys a file for --dir."""
    (tmp_path / "a-file").write_text("")
    assert main(["keys", "--dir", str(tmp_path / under), "n1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("slurm-mig: error: cannot make the key folder ") and "Traceback" not in err


def test_keys_makes_the_folders_above_its_own_0755_whatever_the_umask(tmp_path, capsys):
    """os.makedirs made the folders above the key folder 0777 less the umask: world-writable under umask 0,
    so anyone could move the key folder aside and put theirs in its place."""
    old = os.umask(0)
    try:
        assert main(["keys", "--dir", str(tmp_path / "a" / "keys"), "n1"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "keys").st_mode) == 0o700


def test_an_unsafe_key_file_is_logged_once_per_node_per_window_and_every_refusal_counted(keys, tmp_path, caplog):
    """Anyone who can reach the port can send requests naming a node whose key file is unsafe: each is
    refused (401) and counted, but the reason (path, mode) was logged at ERROR once per request, so a
    loop of them flooded the controller's log. Now once per node per window, with the count not logged."""
    import logging

    n1, n2 = node_auth(keys, "n1"), node_auth(keys, "n2")
    os.chmod(keys / "n1.key", 0o644)
    os.chmod(keys / "n2.key", 0o640)
    ctl_auth = HmacAuth(None, node_keys=NodeKeys(str(keys)))
    clock = [1000.0]
    ctl_auth.clock = lambda: clock[0]  # no wall-clock waits: the window is stepped by hand
    store = open_store(tmp_path / "state.db")
    ctl = Controller(Config(), store, NoSlurm())
    srv = ApiServer("127.0.0.1", 0, ctl_auth, ctl.routes(), ctl.get_routes(),
                    on_error=lambda kind, msg: ctl.metrics.inc("slurm_mig_api_errors_total", (("kind", kind),)))
    srv.start()
    body = json.dumps({"node": "n1", "observed": [], "bindings": {}}).encode()

    def post(auth, node) -> int:
        conn = http.client.HTTPConnection(*srv.address, timeout=5)
        conn.request("POST", "/v1/report", body=body, headers={HEADER: auth.sign(body, node, path="/v1/report")})
        status = conn.getresponse().status
        conn.close()
        return status

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "slurm_mig.api.auth" and r.levelno >= logging.ERROR]

    caplog.set_level(logging.WARNING)
    try:
        assert [post(n1, "n1") for _ in range(40)] == [401] * 40
        assert len(said()) == 1 and "n1.key has mode 0o644" in said()[0] and "must be 0600" in said()[0]
        assert post(n2, "n2") == 401  # another node's line is not held back by n1's
        assert len(said()) == 2 and "n2.key" in said()[1]
        clock[0] += 599.0
        assert post(n1, "n1") == 401
        assert len(said()) == 2
        clock[0] += 1.0  # 600 s after n1's first line
        assert post(n1, "n1") == 401
        assert len(said()) == 3 and "n1.key" in said()[2] and "40 more requests" in said()[2]
        assert post(n1, "n1") == 401
        assert len(said()) == 3
    finally:
        srv.stop()
        store.close()
    assert 'slurm_mig_api_errors_total{kind="auth"} 44' in ctl.metrics.render().decode()  # every refusal


def test_requests_for_an_unsafe_key_file_that_stop_are_summed_up_in_a_closing_line(keys, caplog):
    """The count of refused requests was said only with the next line about the file: when they stopped
    (the node gave up), the log never said how many there had been. Once a whole window passes with none,
    the auth (called by the API server between its polls) says how many."""
    import logging

    n1 = node_auth(keys, "n1")
    os.chmod(keys / "n1.key", 0o644)
    auth = HmacAuth(None, node_keys=NodeKeys(str(keys)))
    clock = [1000.0]
    auth.clock = lambda: clock[0]
    body = b"{}"

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "slurm_mig.api.auth" and r.levelno >= logging.ERROR]

    caplog.set_level(logging.WARNING)
    for _ in range(12):
        with pytest.raises(AuthError):
            auth.verify(n1.sign(body, "n1", path="/v1/report"), body, path="/v1/report")
        clock[0] += 10.0
    assert len(said()) == 1
    clock[0] += auth.UNSAFE_KEY_LOG_EVERY_S - 11.0
    auth.say_ended()
    assert len(said()) == 1  # 599 s since the last one: it may go on
    clock[0] += 1.0
    auth.say_ended()
    assert len(said()) == 2 and "n1.key has mode 0o644" in said()[1], said()
    assert "11 more requests refused for it since the last line about it, not logged, and none in the last 10 min" \
        in said()[1]
    auth.say_ended()
    assert len(said()) == 2
    # The server's periodic call reaches it.
    srv = ApiServer("127.0.0.1", 0, auth, {})
    try:
        with pytest.raises(AuthError):
            auth.verify(n1.sign(body, "n1", path="/v1/report"), body, path="/v1/report")
        with pytest.raises(AuthError):
            auth.verify(n1.sign(body, "n1", path="/v1/report"), body, path="/v1/report")
        clock[0] += auth.UNSAFE_KEY_LOG_EVERY_S
        srv.say_ended()
        assert len(said()) == 4 and "1 more requests refused" in said()[3]
    finally:
        srv.httpd.server_close()


def test_the_log_limit_tracks_a_bounded_number_of_lines():
    """Distinct reasons past the cap (paths of nodes that need not exist) share one slot: no unbounded memory."""
    from slurm_mig.api.loglimit import LogLimiter

    q = LogLimiter(600.0, max_keys=3)
    assert [q.say(f"line {i}", 0.0) for i in range(3)] == [0, 0, 0]
    assert q.say("line 3", 1.0) == 0 and q.say("line 4", 2.0) is None  # the shared slot, said once per window
    assert len(q._last) == 4 and q.say("line 0", 3.0) is None
    assert q.say("line 5", 700.0) == 0  # expired ones are forgotten to make room
    assert len(q._last) <= 3
