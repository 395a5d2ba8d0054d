"""Configuration: defaults, the documented example, resolution order and errors that name the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from slurm_mig import config as cfgmod
from slurm_mig.config import RULES, SECTIONS, Config, load_config, parse_config_text
from slurm_mig.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "etc" / "slurm-mig.toml"


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch, tmp_path):
    """Tests must not pick up the machine's $SLURM_MIG_CONFIG or /etc/slurm-mig."""
    monkeypatch.delenv(cfgmod.ENV_VAR, raising=False)
    monkeypatch.setattr(cfgmod, "SYSTEM_PATH", tmp_path / "no-such-dir" / "slurm-mig.toml")


def write(tmp_path: Path, text: str, name: str = "slurm-mig.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(text: str, tmp_path: Path) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert msg.startswith(f"config {path}: ")
    return msg[len(f"config {path}: "):]


# -- defaults and the example ------------------------------------------------------

def test_defaults_work_for_the_demo():
    c = load_config()
    assert c == Config() and c.source is None
    assert (c.controller.listen_host, c.controller.listen_port) == ("127.0.0.1", 7677)
    assert c.controller.db_busy_timeout_s == 5.0 and c.controller.tick_interval_s > 0
    assert c.node.controller_url == "http://127.0.0.1:7677"
    assert c.node.nvml_backend == "simulated"
    assert c.policy.name == "frag-aware" and c.policy.fallback == "first-fit" and c.slurm.gres_name == "mig"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.controller.listen_port = 1  # type: ignore[misc]


def test_example_config_loads_cleanly_and_matches_the_defaults():
    c = load_config(EXAMPLE)
    assert c == Config()
    assert c.source == str(EXAMPLE)


def test_example_config_documents_every_key():
    lines = EXAMPLE.read_text().splitlines()
    section = None
    seen: dict[str, set[str]] = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\[(\w+)\]\s*$", line)
        if m:
            section = m.group(1)
            seen.setdefault(section, set())
            continue
        m = re.match(r"^(\w+)\s*=", line)
        if m:
            assert lines[i - 1].startswith("#"), f"[{section}].{m.group(1)} has no comment above it"
            seen[section].add(m.group(1))
    assert seen == {s: set(keys) for s, keys in RULES.items()}


def test_configuration_doc_names_every_key():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    for section, keys in RULES.items():
        assert f"[{section}]" in doc
        for key in keys:
            assert f"`{key}`" in doc, f"docs/configuration.md does not describe [{section}].{key}"


def test_rules_cover_every_dataclass_field():
    for name, cls in SECTIONS.items():
        assert set(RULES[name]) == {f.name for f in dataclasses.fields(cls)}


# -- resolution order ----------------------------------------------------------------

def test_explicit_path_wins_over_the_environment(tmp_path, monkeypatch):
    a = write(tmp_path, "[controller]\nlisten_port = 1111\n", "a.toml")
    b = write(tmp_path, "[controller]\nlisten_port = 2222\n", "b.toml")
    monkeypatch.setenv(cfgmod.ENV_VAR, str(b))
    assert load_config(a).controller.listen_port == 1111
    assert load_config().controller.listen_port == 2222


def test_system_file_is_used_when_present(tmp_path, monkeypatch):
    sysfile = write(tmp_path, "[log]\nlevel = \"debug\"\n", "system.toml")
    monkeypatch.setattr(cfgmod, "SYSTEM_PATH", sysfile)
    c = load_config()
    assert c.log.level == "DEBUG" and c.source == str(sysfile)


def test_missing_explicit_files_are_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    monkeypatch.setenv(cfgmod.ENV_VAR, str(tmp_path / "env.toml"))
    with pytest.raises(ConfigError, match=r"file not found"):
        load_config()


def test_partial_file_keeps_other_defaults_and_resolves_relative_paths(tmp_path):
    c = load_config(write(tmp_path, '[controller]\ndb_path = "state/state.db"\ntick_interval_s = 1\n'
                                    '[slurm]\npartitions = ["gpu", "debug"]\n'))
    assert c.controller.db_path == str(tmp_path / "state" / "state.db")
    assert c.controller.tick_interval_s == 1.0 and isinstance(c.controller.tick_interval_s, float)
    assert c.slurm.partitions == ("gpu", "debug")
    assert c.node == Config().node


# -- errors --------------------------------------------------------------------------

def test_bad_value_names_the_key_and_the_expectation(tmp_path):
    msg = error_of('[controller]\ntick_interval_s = "fast"\n', tmp_path)
    assert msg == '[controller].tick_interval_s: expected a number > 0, got "fast"'


@pytest.mark.parametrize("text, expected", [
    ("[controller]\ntick_interval_s = 0\n", "[controller].tick_interval_s: expected a number > 0, got 0"),
    ("[controller]\ndb_busy_timeout_s = -1\n", "[controller].db_busy_timeout_s: expected a number >= 0, got -1"),
    ("[controller]\nlisten_port = 70000\n", "[controller].listen_port: expected an integer >= 1 and <= 65535, got 70000"),
    ("[controller]\nlisten_port = true\n", "[controller].listen_port: expected an integer >= 1 and <= 65535, got true"),
    ("[controller]\nlisten_port = 7677.5\n", "[controller].listen_port: expected an integer >= 1 and <= 65535, got 7677.5"),
    ('[node]\nnvml_backend = "fake"\n', '[node].nvml_backend: expected one of "real", "simulated", got "fake"'),
    ('[node]\ncontroller_url = "head:7677"\n', "[node].controller_url: expected an http:// or https:// URL"),
    # urlparse raises ValueError for an unclosed IPv6 bracket: a traceback, not the key
    ('[node]\ncontroller_url = "http://[::1:7677"\n', "[node].controller_url: expected an http:// or https:// URL"),
    ('[node]\ncontroller_url = "http://[head-node]:7677"\n', "[node].controller_url: expected an http:// or https:// URL"),
    ('[node]\nsim_gpu_model = "V100"\n', "[node].sim_gpu_model: expected a GPU model: "),
    ('[auth]\nmethod = "kerberos"\n', '[auth].method: expected one of "munge", "hmac", got "kerberos"'),
    ('[auth]\nmethod = "hmac"\nhmac_key_file = ""\n', "[auth].hmac_key_file: expected a key file path"),
    ('[slurm]\npartitions = "gpu"\n', '[slurm].partitions: expected an array of non-empty strings, got "gpu"'),
    ('[slurm]\ngres_name = "mig:3g"\n', '[slurm].gres_name: expected "mig" (the only GRES name'),
    ('[slurm]\ngres_name = "gpu"\n', '[slurm].gres_name: expected "mig" (the only GRES name'),
    ('[policy]\nname = ""\n', '[policy].name: expected a policy name'),
    ('[policy]\nrl_max_hold_h = -1\n', '[policy].rl_max_hold_h: expected a number >= 0 and <= 720, got -1'),
    ('[policy]\nrl_max_hold_h = "12h"\n', '[policy].rl_max_hold_h: expected a number >= 0 and <= 720, got "12h"'),
    ('[log]\nlevel = "loud"\n', '[log].level: expected one of "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"'),
    ('controller = 1\n', "[controller] must be a table (a [controller] section), got 1"),
    ('port = 1\n', "unknown top-level key 'port'; keys belong in a section: [controller]"),
    ('[[controller]]\nlisten_port = 1\n', "[controller] must be a table"),
])
def test_bad_values(tmp_path, text, expected):
    assert error_of(text, tmp_path).startswith(expected)


@pytest.mark.parametrize("text, expected", [
    # A number no float holds: float() raised OverflowError, a traceback instead of the key.
    ("[controller]\ntick_interval_s = 1" + "0" * 400 + "\n",
     "[controller].tick_interval_s: expected a number > 0, got an integer of 401 digits, over TOML's 64 bits"),
    # Accepted, then every 500th tick (the first included) failed in the store's prune: SQLite takes 64 bits.
    ("[controller]\nkeep_decisions = 9223372036854775808\n",
     "[controller].keep_decisions: expected an integer >= 1, got an integer of 19 digits, over TOML's 64 bits"),
    ("[node]\nsim_gpu_count = -9223372036854775809\n",
     "[node].sim_gpu_count: expected an integer >= 1 and <= 64, got an integer of 19 digits, over TOML's 64 bits"),
    # Over Python's 4,300 digits tomllib itself raised ValueError, naming no file.
    ("[controller]\nkeep_events = " + "1" * 5000 + "\n", "cannot read it as TOML: Exceeds the limit (4300 digits)"),
])
def test_an_integer_over_tomls_64_bits_is_an_error_naming_the_key(tmp_path, text, expected):
    """TOML's integers are 64-bit signed and one that is not "must" be an error; tomllib reads any size."""
    assert error_of(text, tmp_path).startswith(expected)


def test_the_largest_64_bit_integer_is_still_taken(tmp_path):
    assert load_config(write(tmp_path, "[controller]\nkeep_events = 9223372036854775807\n")).controller.keep_events \
        == 2 ** 63 - 1


def test_unknown_keys_and_sections_suggest_the_right_name(tmp_path):
    assert error_of("[controller]\ntick_intervall_s = 5\n", tmp_path).startswith(
        "[controller].tick_intervall_s: unknown key (did you mean tick_interval_s?)")
    assert error_of("[contoller]\nlisten_port = 1\n", tmp_path) == "unknown section [contoller] (did you mean [controller]?)"
    assert "(it belongs in [node])" in error_of("[controller]\ncontroller_url = \"http://x\"\n", tmp_path)
    assert "[policy] is a section of its own" in error_of('[controller]\npolicy = "first-fit"\n', tmp_path)
    assert error_of("[node]\nzzz = 1\n", tmp_path).startswith("[node].zzz: unknown key; known keys: controller_url")


def test_toml_syntax_errors_report_line_and_column(tmp_path):
    msg = error_of('[controller]\nlisten_port = 7677\ntick_interval_s = = 5\n', tmp_path)
    assert re.match(r"TOML syntax error at line 3, column \d+: ", msg), msg
    msg = error_of('[controller\n', tmp_path)
    assert msg.startswith("TOML syntax error at line 1, column")


def test_not_utf8(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_bytes(b"[log]\nfile = \"\xff\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(p)


def test_config_opens_the_store(tmp_path):
    from slurm_mig.store import open_store_from_config

    c = load_config(write(tmp_path, '[controller]\ndb_path = "db/state.db"\ndb_busy_timeout_s = 0.5\n'))
    store = open_store_from_config(c)
    assert store.busy_timeout_s == 0.5 and Path(store.path) == tmp_path / "db" / "state.db"
    store.close()


def test_as_dict_is_plain_data():
    d = Config().as_dict()
    assert set(d) == set(SECTIONS) and d["slurm"]["partitions"] == []
    import json

    json.dumps(d)


@pytest.mark.parametrize("host", ["head-node:7677", "::1", "no-such-host.invalid"])
def test_a_listen_host_the_controller_cannot_listen_on_is_an_error_naming_the_key(tmp_path, host):
    """listen_host takes any name without spaces or "/" (an IPv6 address the IPv4 server cannot take,
    "host:port", a name that does not resolve): the controller then stopped at its start with socket's
    traceback ("Name or service not known"), naming no setting."""
    from types import SimpleNamespace

    from slurm_mig.controller.cli import serve

    cfg = load_config(write(tmp_path, f'[controller]\nlisten_host = "{host}"\nlisten_port = 1\n'))
    stub = SimpleNamespace(routes=dict, get_routes=dict, metrics=None)
    with pytest.raises(ConfigError, match=re.escape(f"config {tmp_path}/slurm-mig.toml: [controller].listen_host, "
                                                    f"listen_port: cannot listen on {host}:1: ")):
        serve(cfg, stub)


# -- time settings: bounded by what uses them ---------------------------------------------

TIMEOUTS = [("controller", "db_busy_timeout_s"), ("node", "request_timeout_s"), ("node", "layout_lock_wait_s"),
            ("node", "hook_time_limit_s"), ("slurm", "command_timeout_s")]
PERIODS = [("controller", "tick_interval_s"), ("controller", "node_stale_after_s"),
           ("node", "health_check_interval_s"), ("auth", "max_clock_skew_s"), ("auth", "replay_window_s")]


def test_every_seconds_setting_is_a_timeout_or_a_period():
    assert sorted(TIMEOUTS + PERIODS) == sorted((s, k) for s, keys in RULES.items() for k in keys if k.endswith("_s"))


@pytest.mark.parametrize("value", ["1e10", "1e308", "1e400", "inf", "9223372036854775807"])
@pytest.mark.parametrize("section, key, bound", [(s, k, "86,400 s (a day)") for s, k in TIMEOUTS]
                         + [(s, k, "31,536,000 s (365 days)") for s, k in PERIODS])
def test_a_time_setting_too_large_for_what_uses_it_is_an_error_naming_the_key(tmp_path, section, key, bound, value):
    """Any number passed: past ~9.2e9 s sockets, locks and time.sleep raise OverflowError (request_timeout_s:
    every hook's request; command_timeout_s past 24.8 days already: poll() takes 32-bit milliseconds, so
    every Slurm command failed), SQLite's busy_timeout silently became 0 past 24.8 days (every contended
    database call failed at once), a tick interval past ~3e11 s failed the scheduler at the start."""
    assert f"[{section}].{key}: expected a number " in error_of(f"[{section}]\n{key} = {value}\n", tmp_path)
    assert error_of(f"[{section}]\n{key} = {value}\n", tmp_path).split(", got ")[0].endswith(f" and <= {bound}")


@pytest.mark.parametrize("section, key, bound", [(s, k, 86_400.0) for s, k in TIMEOUTS]
                         + [(s, k, 365 * 86_400.0) for s, k in PERIODS])
def test_a_time_setting_at_its_bound_is_taken(tmp_path, section, key, bound):
    c = load_config(write(tmp_path, f"[{section}]\n{key} = {int(bound)}\n"))
    assert getattr(getattr(c, section), key) == bound
    assert error_of(f"[{section}]\n{key} = {bound + 0.5}\n", tmp_path).startswith(f"[{section}].{key}: expected")
    assert error_of(f'[{section}]\n{key} = "1 day"\n', tmp_path).startswith(  # the bound is said only when passed
        f'[{section}].{key}: expected a number > 0, got "1 day"' if key != "db_busy_timeout_s" else
        f'[{section}].{key}: expected a number >= 0, got "1 day"')


def test_the_bounds_fit_what_uses_the_settings(tmp_path):
    """At their bounds the settings work where they are used: no OverflowError, no silent 0."""
    import logging
    import threading

    from apscheduler.schedulers.background import BackgroundScheduler

    from slurm_mig.api.auth import HmacAuth
    from slurm_mig.api.client import ControllerClient, ControllerUnavailable
    from slurm_mig.controller.cli import schedule_ticks
    from slurm_mig.slurm.runner import run_slurm
    from slurm_mig.store import open_store

    day, year = cfgmod.MAX_TIMEOUT_S, cfgmod.MAX_PERIOD_S
    assert run_slurm(["true"], timeout=day).returncode == 0  # poll() in 32-bit milliseconds: 24.8 days
    store = open_store(str(tmp_path / "s.db"), busy_timeout_s=day)
    assert store.busy_timeout_s == day
    assert store.db.execute("PRAGMA busy_timeout").fetchone()[0] == int(day * 1000)  # past 24.8 days: 0
    store.close()
    client = ControllerClient("http://127.0.0.1:1", HmacAuth(b"k" * 32), "n1", timeout_s=day, retries=0)
    with pytest.raises(ControllerUnavailable):
        client.call("/v1/health", {})
    assert year < threading.TIMEOUT_MAX and int(year) < 2 ** 31  # a MUNGE TTL is a C int
    sched = BackgroundScheduler()

    class _Metrics:
        def inc(self, *_a):
            pass

    schedule_ticks(sched, lambda: None, year, _Metrics(), logging.getLogger("test"))
    sched.start(paused=True)
    try:
        assert sched.get_jobs()[0].next_run_time is not None
    finally:
        sched.shutdown(wait=False)


def test_a_node_keys_folder_with_munge_is_an_error_not_ignored(tmp_path):
    """With method = "munge" the controller built MungeAuth and never read hmac_node_keys_dir: a site that
    set it believed each node could sign for itself only, when (with MUNGE) any node's root can speak for
    every node (docs/security.md §7)."""
    msg = error_of('[auth]\nmethod = "munge"\nhmac_node_keys_dir = "/etc/slurm-mig/node-keys"\n', tmp_path)
    assert msg == ('[auth].hmac_node_keys_dir: expected "" when [auth].method = "munge" (a key per node needs '
                   'method = "hmac"; with MUNGE it would be ignored), got "/etc/slurm-mig/node-keys"')
    assert error_of('[auth]\nhmac_node_keys_dir = "keys"\n', tmp_path).startswith(  # munge is the default
        "[auth].hmac_node_keys_dir: expected \"\" when [auth].method = \"munge\"")
    c = load_config(write(tmp_path, '[auth]\nmethod = "hmac"\nhmac_node_keys_dir = "keys"\n'))
    assert c.auth.hmac_node_keys_dir == str(tmp_path / "keys")
    assert load_config(write(tmp_path, '[auth]\nmethod = "munge"\nhmac_node_keys_dir = ""\n')).auth.method == "munge"
