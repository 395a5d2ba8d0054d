"""[auth].controller_user: a controller run as the SlurmUser with MUNGE. Nodes accept answers signed by that
user or by root; the controller still serves requests from root only. Unit tests of MungeAuth with credentials
decoded by a stand-in for munged, the same with a real private munged and credentials made as another user
(setpriv), the config key, and the controller's refusal to start as a user the nodes would refuse."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_mig import config as cfgmod
from slurm_mig.api.auth import AuthError, MungeAuth, _response_digest, auth_from_settings
from slurm_mig.config import AuthConfig, Config, load_config
from slurm_mig.controller.cli import check_answer_signer, make_auth
from slurm_mig.errors import ConfigError

SLURM_UID = 64030  # the SlurmUser the controller runs as
OTHER_UID = 1000  # any other user on the cluster


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch, tmp_path):
    monkeypatch.delenv(cfgmod.ENV_VAR, raising=False)
    monkeypatch.setattr(cfgmod, "SYSTEM_PATH", tmp_path / "no-such-dir" / "slurm-mig.toml")


class Munged:
    """Stands in for munged: remembers each credential with the uid of the process that made it."""

    def __init__(self):
        self.creds: dict[str, tuple[bytes, int]] = {}

    def auth(self, uid: int, auth: MungeAuth) -> MungeAuth:
        """``auth`` (as built from a config) encoding as ``uid`` and decoding through this munged."""
        def encode(payload: bytes) -> str:
            cred = f"MUNGE:{len(self.creds)}:"
            self.creds[cred] = (payload, uid)
            return cred

        def decode(cred: str):
            if cred not in self.creds:
                raise AuthError("MUNGE credential rejected: invalid credential (bad format or key)")
            payload, who = self.creds.pop(cred)  # munged refuses a credential decoded twice
            return payload, who, who, "127.0.0.1"

        auth.lib = None
        auth._encode, auth._decode = encode, decode
        return auth


def configured(controller_user) -> Config:
    return Config(auth=AuthConfig(controller_user=controller_user))


def node_and_controller(munged: Munged, controller_user, controller_uid: int):
    """A node's hook (root) and the controller (running as ``controller_uid``), built as each builds its
    MungeAuth: the node through auth_from_settings (node/context.py), the controller through make_auth."""
    cfg = configured(controller_user)
    node = munged.auth(0, auth_from_settings("munge", controller_uid=cfg.auth.controller_uid))
    controller = munged.auth(controller_uid, make_auth(cfg))
    return node, controller


def test_answers_signed_by_the_controller_user_are_accepted_its_requests_are_not():
    munged = Munged()
    node, controller = node_and_controller(munged, SLURM_UID, SLURM_UID)
    body = b'{"node": "n1"}'
    request = node.sign(body, "n1", path="/v1/report")
    assert controller.verify(request, body, path="/v1/report").uid == 0  # the hook's request, as before
    answer = b'{"ok": true}'
    node.verify_response(request, 200, controller.sign_response(request, 200, answer), answer)
    # root's answers still pass (a controller run as root with the same config)
    root = munged.auth(0, make_auth(configured(SLURM_UID)))
    node.verify_response(request, 200, root.sign_response(request, 200, answer), answer)
    # another user's answer is refused, whoever it is
    other = munged.auth(OTHER_UID, make_auth(configured(SLURM_UID)))
    with pytest.raises(AuthError, match=f"answer signed by uid {OTHER_UID}, not by the controller"):
        node.verify_response(request, 200, other.sign_response(request, 200, answer), answer)
    # and the controller's own user cannot send requests: only root's (the hooks') are served
    from_slurm = controller.sign(body, "n1", path="/v1/report")
    with pytest.raises(AuthError, match=f"requests from uid {SLURM_UID} are not allowed"):
        controller.verify(from_slurm, body, path="/v1/report")
    assert controller.allowed_uids == node.allowed_uids == (0,)
    assert node.answer_uids == (0, SLURM_UID)


def test_by_default_only_roots_answers_are_accepted():
    munged = Munged()
    node, controller = node_and_controller(munged, "root", SLURM_UID)
    request = node.sign(b"{}", "n1", path="/v1/report")
    with pytest.raises(AuthError, match=f"answer signed by uid {SLURM_UID}, not by the controller"):
        node.verify_response(request, 200, controller.sign_response(request, 200, b"{}"), b"{}")
    assert node.answer_uids == (0,)


def test_a_user_name_is_resolved_on_the_host_that_reads_it(tmp_path):
    nobody = pwd.getpwnam("nobody").pw_uid
    for value, uid in (('"nobody"', nobody), (f'"{nobody}"', nobody), ("4242", 4242), ('"4242"', 4242),
                       ('"root"', 0)):
        (tmp_path / "c.toml").write_text(f"[auth]\ncontroller_user = {value}\n")
        assert load_config(tmp_path / "c.toml").auth.controller_uid == uid
    assert Config().auth.controller_user == "root" and Config().auth.controller_uid == 0


@pytest.mark.parametrize("value, expected", [
    ('"no-such-user-here"', 'expected a user this host knows (a name in its passwd, e.g. the SlurmUser) or a uid, '
                            'got "no-such-user-here"'),
    ("-1", "expected a user name (e.g. \"slurm\") or a uid (0 to 4294967294), got -1"),
    ("4294967295", "expected a user name"),
    ('"99999999999"', "expected a user name"),
    ('""', "expected a user name"),
    ('"slurm user"', "expected a user name"),
    ("true", "expected a user name"),
    ("1.5", "expected a user name"),
])
def test_a_user_that_is_not_one_is_an_error_naming_the_key_and_the_file(tmp_path, value, expected):
    path = tmp_path / "c.toml"
    path.write_text(f"[auth]\ncontroller_user = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"config {path}: [auth].controller_user: {expected}")


def test_a_node_hook_accepts_the_controller_users_answers(tmp_path):
    """The hooks' settings carry the uid their config names to the node's MungeAuth."""
    from slurm_mig.node.context import Node, NodeSettings

    path = tmp_path / "slurm-mig.toml"
    path.write_text(f'[node]\ncache_dir = "{tmp_path}/node"\nsim_state_path = "{tmp_path}/sim.json"\n'
                    f'[auth]\ncontroller_user = "nobody"\n')
    os.environ[cfgmod.ENV_VAR] = str(path)
    try:
        settings = NodeSettings.load("n1")
    finally:
        del os.environ[cfgmod.ENV_VAR]
    assert settings.controller_uid == pwd.getpwnam("nobody").pw_uid
    auth = Node("n1", settings).client.auth
    assert auth.answer_uids == (0, settings.controller_uid) and auth.allowed_uids == (0,)


def test_a_controller_run_as_a_user_the_nodes_refuse_does_not_start():
    nobody = pwd.getpwnam("nobody").pw_uid
    with pytest.raises(ConfigError) as info:
        check_answer_signer(configured("root"), euid=nobody)
    assert str(info.value).startswith(
        f'config <built-in defaults>: [auth].controller_user: the controller runs as nobody (uid {nobody}), but with '
        f'method = "munge" the nodes accept answers signed by root or by controller_user ("root", uid 0) only')
    assert 'set controller_user = "nobody" in [auth]' in str(info.value)
    with pytest.raises(ConfigError, match=r"runs as uid 4242, .* set controller_user = 4242 in"):
        check_answer_signer(configured("nobody"), euid=4242)
    check_answer_signer(configured("nobody"), euid=nobody)  # the user the nodes accept
    check_answer_signer(configured("nobody"), euid=0)  # root is always accepted
    hmac = replace(configured("root"), auth=AuthConfig(method="hmac"))
    check_answer_signer(hmac, euid=nobody)  # answers carry the key's MAC, not a uid


# -- a real munged, credentials made as another user ---------------------------------------

def _munge_as(uid: int, socket: str, payload: bytes) -> str:
    out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "munge",
                          "--socket", socket], input=payload, capture_output=True, timeout=10, check=True)
    return "munge " + out.stdout.decode().strip()


@pytest.fixture
def shared_munged():
    """A private munged whose socket other users can reach (pytest's tmp_path is root's alone)."""
    from tests.test_api_origin import _start_munged, _stop_munged

    if os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("munge"):
        pytest.skip("needs root, setpriv and munge to make credentials as other users")
    folder = Path(tempfile.mkdtemp(prefix="slurm-mig-ctluid-"))
    try:
        folder.chmod(0o755)
        socks, pids = _start_munged(folder, (("here", []),))
        try:
            yield socks[0]
        finally:
            _stop_munged(pids)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("use_library", [True, False], ids=["libmunge", "commands"])
def test_real_munge_answers_of_the_controller_user_pass_and_its_requests_do_not(shared_munged, use_library):
    nobody = pwd.getpwnam("nobody").pw_uid
    cfg = replace(configured("nobody"), auth=AuthConfig(controller_user="nobody", munge_socket=shared_munged))
    node = auth_from_settings("munge", munge_socket=shared_munged, controller_uid=cfg.auth.controller_uid)
    controller = make_auth(cfg)
    node.lib = node.lib if use_library else None
    controller.lib = controller.lib if use_library else None
    if use_library and node.lib is None:
        pytest.skip("libmunge.so.2 cannot be loaded")
    body, answer = b'{"node": "n1"}', b'{"ok": true}'
    request = node.sign(body, "n1", path="/v1/report")
    assert controller.verify(request, body, path="/v1/report").uid == 0
    want = f"slurm-mig/1-response {_response_digest(request, 200, answer)}".encode()
    node.verify_response(request, 200, _munge_as(nobody, shared_munged, want), answer)  # the controller user
    node.verify_response(request, 200, node.sign_response(request, 200, answer), answer)  # root
    with pytest.raises(AuthError, match="answer signed by uid 4242, not by the controller"):
        node.verify_response(request, 200, _munge_as(4242, shared_munged, want), answer)
    digest = hashlib.sha256(body).hexdigest()
    as_nobody = _munge_as(nobody, shared_munged, f"slurm-mig/2 {digest} n1 POST /v1/report".encode())
    with pytest.raises(AuthError, match=f"requests from uid {nobody} are not allowed"):
        controller.verify(as_nobody, body, path="/v1/report")


def test_the_controller_command_run_as_such_a_user_exits_2_naming_the_key():
    """`slurm-mig controller` started as nobody, with controller_user left at root: refused before it opens
    the database or listens (it ran, and the nodes refused every answer)."""
    from tests.helpers import skip_unless_nobody_can_run_the_project

    skip_unless_nobody_can_run_the_project()
    folder = Path(tempfile.mkdtemp(prefix="slurm-mig-ctluid-"))
    try:
        folder.chmod(0o755)
        (folder / "db").mkdir(mode=0o755)
        config = folder / "slurm-mig.toml"
        config.write_text(f'[controller]\ndb_path = "{folder}/db/state.db"\n')
        config.chmod(0o644)
        nobody = pwd.getpwnam("nobody")
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              sys.executable, "-c", "import sys; from slurm_mig.cli import main; sys.exit(main())", "--config", str(config), "controller"],
                             capture_output=True, text=True, timeout=60, cwd=root,
                             env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root)})
        assert out.returncode == 2, out.stderr
        assert f"[auth].controller_user: the controller runs as nobody (uid {nobody.pw_uid})" in out.stderr
        assert not (folder / "db" / "state.db").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
