"""The node-to-controller channel: HMAC and MUNGE authentication over real HTTP on loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from slurm_mig.api.auth import AuthError, HmacAuth, MungeAuth, create_key, load_key
from slurm_mig.api.client import ControllerClient, ControllerRefused, ControllerUnavailable
from slurm_mig.api.server import ApiServer, RequestRejected

KEY = b"k" * 64


def echo(payload, principal):
    if payload.get("bad"):
        raise RequestRejected("bad field")
    if payload.get("crash"):
        raise RuntimeError("boom")
    return {"echo": payload, "uid": principal.uid, "host": principal.host}


@pytest.fixture
def server():
    errors = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {"/v1/echo": echo},
                    {"/healthz": lambda: ("text/plain", b"ok\n")}, on_error=lambda k, m: errors.append(k)).start()
    srv.errors = errors
    yield srv
    srv.stop()


def url(srv):
    host, port = srv.address
    return f"http://{host}:{port}"


def test_signed_request_round_trip(server):
    client = ControllerClient(url(server), HmacAuth(KEY), "n1")
    assert client.call("/v1/echo", {"job": 7}) == {"echo": {"job": 7}, "uid": 0, "host": "n1"}


def test_wrong_key_refused(server):
    client = ControllerClient(url(server), HmacAuth(b"x" * 64), "n1")
    with pytest.raises(ControllerRefused) as exc:
        client.call("/v1/echo", {"job": 7})
    assert exc.value.status == 401
    assert server.errors == ["auth"]


def test_unauthenticated_refused(server):
    import urllib.request, urllib.error
    req = urllib.request.Request(url(server) + "/v1/echo", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=5)
    assert exc.value.code == 401


def test_replayed_and_altered_requests_refused():
    auth = HmacAuth(KEY)
    body = b'{"job": 1}'
    header = auth.sign(body, "n1")
    assert auth.verify(header, body).host == "n1"
    with pytest.raises(AuthError, match="replayed"):
        auth.verify(header, body)
    with pytest.raises(AuthError, match="does not match"):
        auth.verify(auth.sign(body, "n1"), b'{"job": 2}')
    # A node name swapped into a valid header breaks the signature.
    h = auth.sign(body, "n1").split(" ")
    h[3] = "n2"
    with pytest.raises(AuthError, match="does not match"):
        auth.verify(" ".join(h), body)


def test_expired_request_refused():
    auth = HmacAuth(KEY, max_skew_s=30)
    body = b"{}"
    with pytest.raises(AuthError, match="off"):
        auth.verify(auth.sign(body, "n1", now=time.time() - 120), body)


def test_rejection_and_crash_are_reported_not_fatal(server):
    client = ControllerClient(url(server), HmacAuth(KEY), "n1", retries=0)
    with pytest.raises(ControllerRefused, match="bad field") as exc:
        client.call("/v1/echo", {"bad": 1})
    assert exc.value.status == 422
    with pytest.raises(ControllerUnavailable, match="boom"):
        client.call("/v1/echo", {"crash": 1})
    assert client.call("/v1/echo", {"ok": 1})["echo"] == {"ok": 1}


def test_malformed_json_and_oversize(server):
    import http.client
    host, port = server.address
    auth = HmacAuth(KEY)
    conn = http.client.HTTPConnection(host, port, timeout=5)
    body = b"{not json"
    conn.request("POST", "/v1/echo", body=body, headers={"X-Slurm-Mig-Auth": auth.sign(body, "n1")})
    assert conn.getresponse().status == 400
    conn.close()
    conn = http.client.HTTPConnection(host, port, timeout=5)
    conn.putrequest("POST", "/v1/echo")
    conn.putheader("Content-Length", str(10 << 20))
    conn.endheaders()
    assert conn.getresponse().status == 413


def test_controller_down_is_unavailable():
    client = ControllerClient("http://127.0.0.1:9", HmacAuth(KEY), "n1", timeout_s=1, retries=0)
    with pytest.raises(ControllerUnavailable):
        client.call("/v1/echo", {})


def test_open_get_route(server):
    import urllib.request
    assert urllib.request.urlopen(url(server) + "/healthz", timeout=5).read() == b"ok\n"


def test_key_file_permissions(tmp_path):
    path = tmp_path / "key"
    create_key(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(load_key(str(path))) == 64
    os.chmod(path, 0o644)
    with pytest.raises(AuthError, match="must be 0600"):
        load_key(str(path))


def _munge_socket():
    for candidate in (os.environ.get("SLURM_MIG_MUNGE_SOCKET"), "/run/munge/munge.socket.2"):
        if candidate and os.path.exists(candidate) and shutil.which("munge"):
            ok = subprocess.run(["munge", "--socket", candidate, "-n"], capture_output=True).returncode == 0
            if ok:
                return candidate
    return None


@pytest.fixture
def munge_socket(tmp_path):
    sock = _munge_socket()
    if sock:
        yield sock
        return
    if not shutil.which("munged"):
        pytest.skip("munge is not installed (the slurm test cluster installs it)")
    key = tmp_path / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    sock = str(tmp_path / "munge.socket")
    proc = subprocess.run(["munged", "--force", f"--socket={sock}", f"--key-file={key}",
                           f"--pid-file={tmp_path}/munged.pid", f"--log-file={tmp_path}/munged.log",
                           f"--seed-file={tmp_path}/munged.seed"], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot start a private munged: {proc.stderr.decode()}")
    yield sock
    pid = int((tmp_path / "munged.pid").read_text())
    os.kill(pid, 15)


def test_munge_round_trip_and_replay(munge_socket):
    auth = MungeAuth(munge_socket, allowed_uids=(os.getuid(),))
    body = b'{"job": 1}'
    header = auth.sign(body, "n1")
    p = auth.verify(header, body)
    assert p.uid == os.getuid() and p.scheme == "munge"
    with pytest.raises(AuthError, match="[Rr]eplay"):
        auth.verify(header, body)
    with pytest.raises(AuthError, match="does not cover"):
        auth.verify(auth.sign(body, "n1"), b'{"job": 2}')
    with pytest.raises(AuthError):
        auth.verify("munge MUNGE:forged:", body)


def test_munge_disallowed_uid(munge_socket):
    auth = MungeAuth(munge_socket, allowed_uids=(424242,))
    with pytest.raises(AuthError, match="not allowed"):
        auth.verify(auth.sign(b"{}"), b"{}")
