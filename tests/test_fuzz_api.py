"""Fuzzing the node-to-controller API: a real Controller behind a real ApiServer on loopback.

Every POST route gets hypothesis-generated bodies, both arbitrary JSON and near-valid payloads
(the right keys with hostile values: wrong types, NaN/inf, negative or huge numbers, unknown
profiles, shell metacharacters, unicode, very long strings), all correctly signed so they reach
the handlers. The server must answer each with 200, 400 or 422 (never a 500, never a dropped
connection), and the state it keeps must stay sound: no two live jobs bound to the same or
overlapping slices, and the controller's tick still runs.

Unsigned, forged, altered, expired and replayed requests and random auth headers are refused
with 401 before any handler runs.

Examples per test: ``SLURM_MIG_FUZZ_EXAMPLES`` (default 150; docs/reliability.md gives the
figures of a long run). ``pytest --hypothesis-show-statistics`` prints how many were tried.
"""

from __future__ import annotations

import http.client
import json
import os
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slurm_mig.api.auth import HEADER, NODE_NAME, AuthError, HmacAuth
from slurm_mig.api.server import ApiServer
from slurm_mig.config import Config
from slurm_mig.controller.service import Controller
from slurm_mig.store import open_store

KEY = b"f" * 64
EXAMPLES = int(os.environ.get("SLURM_MIG_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
ROUTES = ("/v1/prolog", "/v1/bound", "/v1/bind-failed", "/v1/epilog", "/v1/report", "/v1/applied")


class StubSlurm:
    """Slurm as the controller sees it, for in-process tests: a few known jobs, no commands run."""

    def __init__(self):
        self.requeued: list[str] = []

    def jobs(self):
        return []

    def reservations(self):
        return []

    def nodes(self):
        return []

    def job_detail(self, job_id):
        # Slurm answers, for a job without a MIG request (a failed scontrol is answered 503: that is
        # tests/test_faults_controller.py's, not a fuzzing outcome)
        from slurm_mig.slurm.parsers import JobDetail

        return JobDetail(job_id=int(str(job_id).split("_")[0]))

    def scontrol_requeue(self, job_id, **kw):
        self.requeued.append(str(job_id))

    def update_node_gres(self, node, counts, **kw):
        return ",".join(f"mig:{t}:{n}" for t, n in sorted(counts.items()))

    def run(self, argv, **kw):
        raise AssertionError("the controller must not run Slurm commands from a request handler")


def _seed(store):
    now = time.time()
    for i, prof in enumerate(["1g", "2g", "3g", "4g", "7g", "1g"], start=1):
        store.upsert_job(str(i), profile=prof, count=1 + (i == 6), user="alice", name=f"j{i}", now=now)
    gpus = [{"gpu": 0, "uuid": "GPU-0", "model": "H100-80GB", "mig_enabled": True},
            {"gpu": 1, "uuid": "GPU-1", "model": "H100-80GB", "mig_enabled": True}]
    insts = [{"gpu": g, "profile": p, "start": s, "uuid": f"MIG-{g}-{s}"}
             for g in (0, 1) for p, s in (("3g", 0), ("2g", 4), ("1g", 6))]
    for node in ("n1", "n2"):
        store.replace_observed(node, gpus, insts, now=now)


@pytest.fixture(scope="module")
def api():
    store = open_store(":memory:")
    _seed(store)
    ctl = Controller(Config(), store, StubSlurm())
    errors: list[str] = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY, max_skew_s=3600), ctl.routes(), ctl.get_routes(),
                    on_error=lambda kind, msg: errors.append(kind)).start()
    srv.ctl, srv.store, srv.errors = ctl, store, errors
    yield srv
    srv.stop()
    store.close()


def post(srv, path: str, body: bytes, header: str | None = "sign") -> tuple[int, dict]:
    host, port = srv.address
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if header == "sign":
        # Signed for the node the body names, as that node's hooks would (a request about another node
        # than its signer's is refused with 403 before any handler runs: tests/test_api_node_keys.py).
        try:
            named = json.loads(body).get("node")
        except (ValueError, AttributeError, RecursionError):
            named = None
        # A name the server takes as a node's (auth.NODE_NAME, no ".."): a hook signs only for its own.
        plain = isinstance(named, str) and NODE_NAME.fullmatch(named) and ".." not in named
        headers[HEADER] = HmacAuth(KEY).sign(body, named if plain else "n1", path=path)
    elif header is not None:
        headers[HEADER] = header
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = {"raw": raw[:200]}
    return resp.status, doc


def _no_overlapping_live_bindings(store) -> None:
    from slurm_mig.mig.profiles import get_model

    rows = store._q("SELECT b.job_id, b.node, b.gpu, b.start, b.profile, g.model FROM bindings b "
                    "LEFT JOIN gpus g ON g.node = b.node AND g.gpu = b.gpu WHERE b.released_at IS NULL")
    by_gpu: dict = {}
    for r in rows:
        by_gpu.setdefault((r["node"], r["gpu"]), []).append(r)
    for key, rs in by_gpu.items():
        for i, a in enumerate(rs):
            for b in rs[i + 1:]:
                assert a["job_id"] != b["job_id"] or a["start"] != b["start"], (key, a, b)
                if a["job_id"] == b["job_id"]:
                    continue
                assert a["start"] != b["start"], f"two live jobs on one instance: {a} {b}"
                if a["model"]:
                    m = get_model(a["model"])
                    try:
                        ma = m.profile(a["profile"]).mask(a["start"])
                        mb = m.profile(b["profile"]).mask(b["start"])
                    except Exception:
                        continue
                    assert not ma & mb, f"two live jobs on overlapping slices: {a} {b}"


# -- strategies ---------------------------------------------------------------------------

HOSTILE_TEXT = st.sampled_from([
    "", " ", "n1; rm -rf /", "$(reboot)", "`id`", "n1\nn2", "../../etc/passwd", "n1\x00", "ñódé-☃",
    "%s%s%n", "' OR 1=1 --", "{\"a\": 1}", "\u202egnp.exe", "-1", "1e999", "NaN", "0x10", "7g.80gb",
    "3g@0,3g@4", "MIG-../../x",
])
LONG_TEXT = st.integers(min_value=300, max_value=5000).map(lambda n: "é" * n)  # long and multi-byte
text = st.text(max_size=40) | HOSTILE_TEXT | LONG_TEXT
number = (st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.sampled_from([0, 1, 7, 8, 63, 64, -1, 2**31, 2**63]))
scalar = st.none() | st.booleans() | number | text
json_any = st.recursive(scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(text, c, max_size=4),
                        max_leaves=12)

profile = st.sampled_from(["1g", "2g", "3g", "4g", "7g", "1g.10gb", "3g.40gb", "1g+me", "1g.dm", "5g", "",
                           "7g.141gb"]) | text
start = st.integers(min_value=-2, max_value=9) | number | text
gpu_idx = st.integers(min_value=-1, max_value=3) | number | text
instance = st.fixed_dictionaries({}, optional={
    "gpu": gpu_idx, "profile": profile, "start": start, "uuid": st.none() | text | st.just("MIG-0-0"),
    "in_use": st.booleans() | scalar,
}) | json_any
instances = st.lists(instance, max_size=4) | json_any
gpu_report = st.fixed_dictionaries({}, optional={
    "index": gpu_idx, "uuid": text, "name": text, "model": st.sampled_from(["H100-80GB", "A30-24GB", "Z9"]) | text,
    "mig_enabled": st.booleans() | scalar, "lost": st.booleans() | scalar, "instances": instances,
    "error": text,
}) | json_any
observed = st.lists(gpu_report, max_size=3) | json_any
bindings = st.dictionaries(st.sampled_from(["1", "2", "3", "7", "x", "1_2", "../1"]) | text, instances,
                           max_size=3) | json_any
result = st.fixed_dictionaries({}, optional={
    "gpu": gpu_idx, "ok": scalar, "reached": scalar, "done": json_any, "error": scalar, "before": text,
    "after": text, "plan": json_any,
}) | json_any
good_node = st.sampled_from(["n1", "n2", "n3"])
good_job = st.sampled_from(["1", "2", "3", "4", "5", "6", "99", "1_2"])
fields = {
    "observed": observed, "bindings": bindings, "instances": instances,
    "binding_times": st.dictionaries(st.sampled_from(["1", "2", "3"]) | text, number | scalar, max_size=3) | json_any,
    "results": st.lists(result, max_size=3) | json_any, "exit_code": number | scalar,
    "derived_ec": number | scalar, "end_time": number | scalar, "local": scalar,
    "lingering": instances, "time": number, "bound_at": number,
    "message_id": st.sampled_from(["0" * 32, "ab" * 8]) | text | json_any, "message_at": number | scalar,
}
# Mostly a good node and job id, so the hostile fields reach the handlers' inner code.
payload = (st.fixed_dictionaries({"node": good_node, "job_id": good_job}, optional=fields)
           | st.fixed_dictionaries({"node": good_node, "job_id": good_job | number | text}, optional=fields)
           | st.fixed_dictionaries({}, optional={"node": good_node | text | number,
                                                 "job_id": good_job | number | text, **fields}))


def _check(srv, path: str, body: bytes) -> int:
    status, doc = post(srv, path, body)
    assert status in (200, 400, 422), (status, path, body[:300], doc)
    if status != 200:
        assert isinstance(doc.get("error"), str) and doc["error"], doc
    return status


@FUZZ
@given(path=st.sampled_from(ROUTES), body=payload)
@example(path="/v1/prolog", body={"node": "."})  # a name no node has: signed as n1's, refused as another node's
def test_near_valid_payloads_never_500(api, path, body):
    raw = json.dumps(body).encode()  # NaN and Infinity included: Python's json reads them back
    _check(api, path, raw)
    _no_overlapping_live_bindings(api.store)


@FUZZ
@given(path=st.sampled_from(ROUTES), body=json_any)
def test_arbitrary_json_never_500(api, path, body):
    _check(api, path, json.dumps(body).encode())


@FUZZ
@given(path=st.sampled_from(ROUTES), body=st.binary(max_size=300))
def test_arbitrary_bytes_never_500(api, path, body):
    status, _ = post(api, path, body)
    assert status in (200, 400, 422), status


def test_deeply_nested_json_is_a_400(api):
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        status, doc = post(api, "/v1/report", body)
        assert status == 400, (status, doc)


def test_tick_still_runs_after_fuzzing(api):
    api.ctl.tick()
    _no_overlapping_live_bindings(api.store)


# -- authentication ------------------------------------------------------------------------

@FUZZ
@given(header=st.text(max_size=200) | st.builds(lambda p: "hmac " + " ".join(p), st.lists(text, max_size=6)),
       body=st.binary(max_size=100))
def test_random_auth_headers_are_refused(header, body):
    auth = HmacAuth(KEY)
    try:
        auth.verify(header, body)
    except AuthError:
        return
    raise AssertionError(f"accepted a forged header {header!r}")


@FUZZ
@given(body=st.binary(max_size=200), ts=st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400", "", "0x1",
                                                        "１２３", "1" * 400]))
def test_signed_with_a_non_finite_timestamp_is_refused(body, ts):
    # Even a holder of the key cannot mint a credential that never expires.
    auth = HmacAuth(KEY, max_skew_s=30)
    nonce = os.urandom(8).hex()
    header = f"hmac {ts} {nonce} n1 {auth._mac(KEY, ts, nonce, 'n1', '', body)}"
    with pytest.raises(AuthError):
        auth.verify(header, body)


@FUZZ
@given(body=st.binary(min_size=1, max_size=200), flip=st.integers(min_value=0))
def test_altered_body_is_refused(body, flip):
    auth = HmacAuth(KEY)
    header = auth.sign(body, "n1")
    i = flip % len(body)
    altered = body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1:]
    with pytest.raises(AuthError):
        auth.verify(header, altered)


def test_unsigned_forged_replayed_and_expired_requests_get_401(api):
    body = json.dumps({"node": "n1", "observed": []}).encode()
    assert post(api, "/v1/report", body, header=None)[0] == 401
    assert post(api, "/v1/report", body, header="hmac 1 2 n1 deadbeef")[0] == 401
    forged = HmacAuth(b"x" * 64).sign(body, "n1", path="/v1/report")
    assert post(api, "/v1/report", body, header=forged)[0] == 401
    good = HmacAuth(KEY).sign(body, "n1", path="/v1/report")
    assert post(api, "/v1/report", body, header=good)[0] == 200
    assert post(api, "/v1/report", body, header=good)[0] == 401  # replayed
    old = HmacAuth(KEY).sign(body, "n1", now=time.time() - 7200, path="/v1/report")
    assert post(api, "/v1/report", body, header=old)[0] == 401  # expired (skew limit 3600 s here)
    status, doc = post(api, "/v1/report", b'{"node": "n1", "observed": [], "x": 1}', header=good)
    assert status == 401  # a valid header for another body


def test_stalled_clients_are_dropped_and_do_not_block_others():
    """Slowloris: connections that send half a request are closed after the I/O timeout; others are served."""
    import socket

    from slurm_mig.api.client import ControllerClient

    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {"/v1/echo": lambda p, who: {"ok": True}},
                    io_timeout_s=0.5).start()
    host, port = srv.address
    try:
        stalled = []
        for _ in range(50):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            stalled.append(s)
        idle = [socket.create_connection((host, port), timeout=5) for _ in range(50)]
        client = ControllerClient(f"http://{host}:{port}", HmacAuth(KEY), "n1", timeout_s=5, retries=0)
        assert client.call("/v1/echo", {}) == {"ok": True}
        time.sleep(1.5)
        for s in stalled + idle:
            s.settimeout(5)
            assert s.recv(100) == b"", "the server kept a stalled connection open"
            s.close()
    finally:
        srv.stop()


def test_connections_past_the_cap_get_503_and_no_thread():
    """One thread per connection, at most max_connections: a flood gets quick 503s (a node's "controller
    unavailable": outbox and fallback), the server keeps its thread count, and serves again after."""
    import socket
    import threading

    from slurm_mig.api.client import ControllerClient

    errors = []
    srv = ApiServer("127.0.0.1", 0, HmacAuth(KEY), {"/v1/echo": lambda p, who: {"ok": True}},
                    on_error=lambda kind, msg: errors.append(kind), io_timeout_s=3, max_connections=4).start()
    host, port = srv.address
    try:
        held = [socket.create_connection((host, port), timeout=5) for _ in range(4)]
        time.sleep(0.3)
        threads = threading.active_count()
        extra = []
        for _ in range(20):
            s = socket.create_connection((host, port), timeout=5)
            extra.append(s)
        replies = [s.recv(200) for s in extra]
        assert all(r.startswith(b"HTTP/1.1 503") for r in replies), replies[:2]
        assert threading.active_count() <= threads + 1
        assert errors.count("busy") == 20
        for s in held + extra:
            s.close()
        time.sleep(0.5)
        client = ControllerClient(f"http://{host}:{port}", HmacAuth(KEY), "n1", timeout_s=5, retries=0)
        assert client.call("/v1/echo", {}) == {"ok": True}
    finally:
        srv.stop()
