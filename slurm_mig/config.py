"""slurm-mig's configuration: one TOML file read into frozen dataclasses.

Where it comes from (load_config): an explicit path, else $SLURM_MIG_CONFIG,
else /etc/slurm-mig/slurm-mig.toml if it exists, else the built-in defaults,
which run the demo (simulated GPUs, everything on 127.0.0.1). Every key is
optional; etc/slurm-mig.toml documents each one, docs/configuration.md too.

Errors are ConfigErrors that name the file, the key and what was expected:
``config /etc/slurm-mig/slurm-mig.toml: [controller].tick_interval_s: expected
a number > 0, got "fast"``. Unknown sections and keys are errors (with a "did
you mean"), so a typo never silently falls back to a default. Relative paths in
the file are taken relative to the file's own directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slurm_mig.errors import ConfigError

ENV_VAR = "SLURM_MIG_CONFIG"
SYSTEM_PATH = Path("/etc/slurm-mig/slurm-mig.toml")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: 30 days: the longest [policy].rl_max_hold_h, and the longest hold an rl guard option may name.
MAX_HOLD_H = 720.0
#: The longest a timeout may be ([controller].db_busy_timeout_s, [node].request_timeout_s, layout_lock_wait_s and
#: hook_time_limit_s, [slurm].command_timeout_s): a day. What waits for them takes milliseconds in 32 bits (poll(), SQLite's
#: busy_timeout: 24.8 days at most), and sockets, locks and time.sleep at most ~9.2e9 s: above those a
#: timeout failed where it was used (OverflowError) or, in SQLite, silently became 0.
MAX_TIMEOUT_S = 86_400.0
#: The longest any other time setting may be (tick_interval_s, node_stale_after_s, health_check_interval_s,
#: max_clock_skew_s, replay_window_s): 365 days. A tick interval past ~3e11 s (a date past the year 9999)
#: failed the scheduler; a MUNGE credential's lifetime is a C int.
MAX_PERIOD_S = 365 * 86_400.0
#: The largest [node].sim_delay_scale (and --sim-delay-scale, $SLURM_MIG_SIM_DELAY_SCALE: argtypes.sim_delay_scale).
#: The factor slows the measured create/destroy times (0.16-0.42 s a step) so a demo's re-carves can be
#: watched; at 1000 the slowest step takes 7 minutes, past any Prolog's PrologEpilogTimeout and the 30 s
#: layout_lock_wait_s, so more simulates only a hang. Unbounded, 1e300 (or inf from a flag) made a create
#: raise OverflowError in time.sleep, and 1e9 sleep for years.
MAX_SIM_DELAY_SCALE = 1000.0
#: The most GPUs a simulated node has ([node].sim_gpu_count, and in all of `nvml sim-init --gpus`).
MAX_SIM_GPUS = 64


@dataclass(frozen=True)
class ControllerConfig:
    """[controller]: the head-node daemon."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 7677
    db_path: str = "/var/lib/slurm-mig/state.db"
    db_group: str = ""  # "" = file mode 0600; a group name = 0640 owned by that group
    db_busy_timeout_s: float = 5.0
    tick_interval_s: float = 5.0
    node_stale_after_s: float = 120.0
    slurm_conf: str = "/etc/slurm/slurm.conf"
    # history kept in the database: the newest decisions and events by count, finished journal entries by age
    keep_decisions: int = 50_000
    # ... and by size, in MB (2**20 bytes) of their stored JSON: a decision at 1,024 GPUs and 10,000 pending
    # jobs is some 3 MB, and 50,000 of them 140 GB
    keep_decisions_mb: int = 1024
    keep_events: int = 200_000
    keep_journal_days: float = 30.0
    # Slurm starts nothing on a node whose every CPU is allocated, unless the partition oversubscribes CPUs
    cpu_full_nodes_wait: bool = True
    # the idle instances of a region the policy reserved for a waiting job are kept from Slurm and other jobs
    hold_reserved: bool = True


@dataclass(frozen=True)
class NodeConfig:
    """[node]: the node-side hooks and agent."""

    controller_url: str = "http://127.0.0.1:7677"
    request_timeout_s: float = 5.0
    cache_dir: str = "/var/lib/slurm-mig/node"
    nvml_backend: str = "simulated"  # "real" | "simulated"
    sim_state_path: str = "/var/lib/slurm-mig/sim-gpus.json"
    sim_gpu_model: str = "H100-80GB"
    sim_gpu_count: int = 1
    sim_delay_scale: float = 1.0
    health_check_interval_s: float = 30.0
    # The longest a Prolog (in all) or a health check waits for the node's layout lock before it gives up:
    # the Prolog requeues its job, the health check leaves its layout steps to its next round
    layout_lock_wait_s: float = 30.0
    # The longest a Prolog or an Epilog runs, in all (from the wrapper's start): every controller call, lock wait
    # and Slurm command gets only what is left of it, and 20 s of it are kept for the fallback's two scontrol
    # calls. Keep it under Slurm's PrologEpilogTimeout, which drains a node whose Prolog or Epilog it kills.
    hook_time_limit_s: float = 90.0


@dataclass(frozen=True)
class AuthConfig:
    """[auth]: how node hooks and the controller prove who they are."""

    method: str = "munge"  # "munge" | "hmac"
    munge_socket: str = "/run/munge/munge.socket.2"
    hmac_key_file: str = "/etc/slurm-mig/hmac.key"
    # controller, method = "hmac": a folder of one key per node (<node>.key); a request is verified with
    # the key of the node it names, hmac_key_file only for nodes without one. "" = the shared key only
    hmac_node_keys_dir: str = ""
    max_clock_skew_s: float = 30.0
    replay_window_s: float = 300.0
    # munge: is a request for node N encoded on N's host (Slurm's NodeAddr)? "warn" counts and logs a
    # mismatch, "enforce" refuses it (403), "off" does not look (slurm_mig/api/origin.py)
    node_origin: str = "warn"
    # munge: the user the controller runs as (a name, or a uid): nodes accept answers signed by it or by root.
    # Requests are accepted from root only, whatever it says (the hooks run as root)
    controller_user: str | int = "root"

    @property
    def controller_uid(self) -> int:
        """The uid of ``controller_user`` (resolved on this host; KeyError for a name it does not know)."""
        return user_uid(self.controller_user)


#: The largest uid: uid_t is 32 bits, and (uid_t)-1 means "no change" to setreuid and chown.
MAX_UID = (1 << 32) - 2


def user_uid(user: str | int) -> int:
    """The uid of a user name (pwd: /etc/passwd, or LDAP, ... through NSS) or of a uid given as a number or
    as digits; KeyError for a name no user has."""
    if isinstance(user, int):
        return user
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        if user.isascii() and user.isdigit():
            return int(user)
        raise


@dataclass(frozen=True)
class SlurmConfig:
    """[slurm]: talking to Slurm."""

    command_timeout_s: float = 30.0
    gres_name: str = "mig"
    partitions: tuple[str, ...] = ()  # () = every partition


@dataclass(frozen=True)
class PolicyConfig:
    """[policy]: which policy decides layouts and placements."""

    name: str = "frag-aware"
    shadow: str = ""  # a second policy run on the same state, logged, never acted on
    model_path: str = ""  # trained model (ONNX) for a learned policy
    fallback: str = "first-fit"  # used when the policy fails or returns an unsafe decision
    rl_max_hold_h: float = 48.0  # rl: a whole-node reservation holds at most this long after submission


@dataclass(frozen=True)
class LogConfig:
    """[log]"""

    level: str = "INFO"
    file: str = ""  # "" = standard error


@dataclass(frozen=True)
class Config:
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str | None = field(default=None, compare=False)  # the file it was read from; None = defaults

    def as_dict(self) -> dict:
        """Plain dict of every section and key (for `slurm-mig config show`)."""
        out = dataclasses.asdict(self)
        out.pop("source", None)
        for section in out.values():
            for k, v in section.items():
                if isinstance(v, tuple):
                    section[k] = list(v)
        return out


SECTIONS: dict[str, type] = {
    "controller": ControllerConfig,
    "node": NodeConfig,
    "auth": AuthConfig,
    "slurm": SlurmConfig,
    "policy": PolicyConfig,
    "log": LogConfig,
}

# -- value checks ------------------------------------------------------------------
# Each returns the converted value or raises _Bad("what was expected").


class _Bad(Exception):
    pass


#: TOML's integers: 64-bit signed. One outside "cannot be represented losslessly, an error must be thrown"
#: (the TOML spec), which tomllib leaves to us: it reads any size.
INT64 = (-(1 << 63), (1 << 63) - 1)


def _int64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and INT64[0] <= v <= INT64[1]


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, int) and not _int64(value):
        return f"an integer of {len(str(abs(value)))} digits, over TOML's 64 bits"
    return repr(value)


def _number(minimum: float | None = None, exclusive: bool = True, maximum: float | None = None,
            ceiling: tuple[float, str] | None = None) -> Callable:
    """A finite number within bounds. ``maximum`` is part of what every error says; ``ceiling``
    (value, in words) only of the error for a number above it (a time setting's sanity bound)."""
    if minimum is None:
        want = "a number"
    else:
        want = f"a number {'>' if exclusive else '>='} {minimum:g}"
    if maximum is not None:
        want += f" and <= {maximum:g}"

    above = f"{want} and <= {ceiling[0]:,.0f} s ({ceiling[1]})" if ceiling is not None else want

    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, int) and not _int64(v)) \
                or math.isnan(v):
            raise _Bad(want)
        if minimum is not None and (v <= minimum if exclusive else v < minimum):
            raise _Bad(want)
        if maximum is not None and v > maximum:
            raise _Bad(want)
        if ceiling is not None and v > ceiling[0]:  # inf too (1e400 in TOML reads as inf)
            raise _Bad(above)
        if not math.isfinite(v):
            raise _Bad(want)
        return float(v)

    return check


def _timeout(minimum: float = 0, exclusive: bool = True) -> Callable:
    """A time setting something waits on (a socket, poll(), SQLite): at most MAX_TIMEOUT_S."""
    return _number(minimum, exclusive=exclusive, ceiling=(MAX_TIMEOUT_S, "a day"))


def _period(minimum: float = 0, exclusive: bool = True) -> Callable:
    """Any other time setting: at most MAX_PERIOD_S."""
    return _number(minimum, exclusive=exclusive, ceiling=(MAX_PERIOD_S, "365 days"))


def _integer(minimum: int, maximum: int | None = None) -> Callable:
    want = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def check(v: Any) -> int:
        if not _int64(v) or v < minimum or (maximum is not None and v > maximum):
            raise _Bad(want)
        return v

    return check


def _string(allow_empty: bool = True) -> Callable:
    def check(v: Any) -> str:
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            raise _Bad("a string" if allow_empty else "a non-empty string")
        return v

    return check


def _boolean(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad("true or false")
    return v


def _choice(*options: str, fold: Callable[[str], str] = str) -> Callable:
    want = "one of " + ", ".join(f'"{o}"' for o in options)

    def check(v: Any) -> str:
        if not isinstance(v, str) or fold(v) not in options:
            raise _Bad(want)
        return fold(v)

    return check


def _path(allow_empty: bool = True) -> Callable:
    def check(v: Any) -> str:
        if not isinstance(v, str) or (not allow_empty and not v.strip()):
            raise _Bad("a file path" if not allow_empty else "a file path or \"\"")
        if "\0" in v:
            raise _Bad("a file path without NUL characters")
        return v

    check.is_path = True  # type: ignore[attr-defined]
    return check


def _user(v: Any) -> str | int:
    """A user name or a uid; whether the name is a user's is asked in _cross_checks (pwd)."""
    want = f'a user name (e.g. "slurm") or a uid (0 to {MAX_UID})'
    if _int64(v):
        if not 0 <= v <= MAX_UID:
            raise _Bad(want)
        return v
    if not isinstance(v, str) or not v or re.search(r"[\s:/\0]", v) or v.startswith("-"):
        raise _Bad(want)
    if v.isascii() and v.isdigit() and (len(v) > 10 or int(v) > MAX_UID):
        raise _Bad(want)
    return v


def _host(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or re.search(r"[\s/]", v):
        raise _Bad("a host name or IP address")
    return v


def _url(v: Any) -> str:
    want = 'an http:// or https:// URL, e.g. "http://head-node:7677"'
    if not isinstance(v, str):
        raise _Bad(want)
    try:  # ValueError: a port out of range, a bracket not closed, brackets round what is no IPv6 address
        parsed = urllib.parse.urlparse(v)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise _Bad(want)
        parsed.port
    except ValueError:
        raise _Bad(want) from None
    return v.rstrip("/")


def _name_list(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise _Bad("an array of non-empty strings")
    return tuple(v)


def _gres_name(v: Any) -> str:
    # job_submit.lua, cli_filter.lua and the GRES parsers all spell it "mig"; another name would be
    # accepted here and then ignored, so it is refused until they read it from here.
    if v != "mig":
        raise _Bad('"mig" (the only GRES name slurm-mig supports yet)')
    return v


def _gpu_model(v: Any) -> str:
    from slurm_mig.errors import GeometryError
    from slurm_mig.mig.profiles import GPU_MODELS, get_model

    want = "a GPU model: " + ", ".join(GPU_MODELS)
    if not isinstance(v, str):
        raise _Bad(want)
    try:
        return get_model(v).name
    except GeometryError:
        raise _Bad(want) from None


def _policy_name(allow_empty: bool) -> Callable:
    # Not checked against the registry here: policies register themselves on import,
    # and a learned one may not be importable where the config is read (a node hook).
    def check(v: Any) -> str:
        if not isinstance(v, str) or (not allow_empty and not v.strip()) or re.search(r"\s", v):
            raise _Bad('a policy name, e.g. "first-fit"' + (' (or "" for none)' if allow_empty else ""))
        return v

    return check


RULES: dict[str, dict[str, Callable]] = {
    "controller": {
        "listen_host": _host,
        "listen_port": _integer(1, 65535),
        "db_path": _path(allow_empty=False),
        "db_group": _string(),
        "db_busy_timeout_s": _timeout(0, exclusive=False),
        "tick_interval_s": _period(),
        "node_stale_after_s": _period(),
        "slurm_conf": _path(allow_empty=False),
        "keep_decisions": _integer(1),
        "keep_decisions_mb": _integer(1),
        "keep_events": _integer(1),
        "keep_journal_days": _number(0),
        "cpu_full_nodes_wait": _boolean,
        "hold_reserved": _boolean,
    },
    "node": {
        "controller_url": _url,
        "request_timeout_s": _timeout(),
        "cache_dir": _path(allow_empty=False),
        "nvml_backend": _choice("real", "simulated"),
        "sim_state_path": _path(allow_empty=False),
        "sim_gpu_model": _gpu_model,
        "sim_gpu_count": _integer(1, MAX_SIM_GPUS),
        "sim_delay_scale": _number(0, exclusive=False, maximum=MAX_SIM_DELAY_SCALE),
        "health_check_interval_s": _period(),
        "layout_lock_wait_s": _timeout(),
        "hook_time_limit_s": _timeout(),
    },
    "auth": {
        "method": _choice("munge", "hmac"),
        "munge_socket": _path(allow_empty=False),
        "hmac_key_file": _path(),
        "hmac_node_keys_dir": _path(),
        "max_clock_skew_s": _period(),
        "replay_window_s": _period(),
        "node_origin": _choice("off", "warn", "enforce"),
        "controller_user": _user,
    },
    "slurm": {
        "command_timeout_s": _timeout(),
        "gres_name": _gres_name,
        "partitions": _name_list,
    },
    "policy": {
        "name": _policy_name(allow_empty=False),
        "shadow": _policy_name(allow_empty=True),
        "model_path": _path(),
        "fallback": _policy_name(allow_empty=False),
        "rl_max_hold_h": _number(0, exclusive=False, maximum=MAX_HOLD_H),
    },
    "log": {
        "level": _choice(*LOG_LEVELS, fold=str.upper),
        "file": _path(),
    },
}

assert all(set(RULES[s]) == {f.name for f in dataclasses.fields(c)} for s, c in SECTIONS.items())


# -- parsing ---------------------------------------------------------------------------

def _did_you_mean(word: str, options: list[str], fmt: str = "{}") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {fmt.format(close[0])}?)" if close else ""


def _where(source: str | os.PathLike | None) -> str:
    return f"config {source}" if source is not None else "config <built-in defaults>"


def parse_config(data: dict, source: str | os.PathLike | None = None) -> Config:
    """Check and convert a parsed TOML document into a Config (raises ConfigError naming the key)."""
    where = _where(source)
    base_dir = Path(source).resolve().parent if source is not None else None
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in SECTIONS:
            hint = _did_you_mean(name, list(SECTIONS), "[{}]")
            if not isinstance(value, dict):
                hint = hint or f"; keys belong in a section: {', '.join(f'[{s}]' for s in SECTIONS)}"
                raise ConfigError(f"{where}: unknown top-level key {name!r}{hint}")
            raise ConfigError(f"{where}: unknown section [{name}]{hint}")
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: [{name}] must be a table (a [{name}] section), got {_show(value)}")
        rules = RULES[name]
        kwargs = {}
        for key, raw in value.items():
            if key not in rules:
                hint = _did_you_mean(key, list(rules))
                if not hint and key in SECTIONS:
                    hint = f" ([{key}] is a section of its own)"
                if not hint:
                    for other, other_rules in RULES.items():
                        if key in other_rules:
                            hint = f" (it belongs in [{other}])"
                            break
                raise ConfigError(f"{where}: [{name}].{key}: unknown key{hint}; known keys: {', '.join(rules)}")
            check = rules[key]
            try:
                val = check(raw)
            except _Bad as bad:
                raise ConfigError(f"{where}: [{name}].{key}: expected {bad}, got {_show(raw)}") from None
            if getattr(check, "is_path", False) and val and base_dir is not None and not os.path.isabs(val):
                val = str(base_dir / val)
            kwargs[key] = val
        sections[name] = SECTIONS[name](**kwargs)
    cfg = Config(**sections, source=None if source is None else str(source))
    _cross_checks(cfg, where)
    return cfg


def _cross_checks(cfg: Config, where: str) -> None:
    if cfg.auth.method == "hmac" and not cfg.auth.hmac_key_file:
        raise ConfigError(f'{where}: [auth].hmac_key_file: expected a key file path when [auth].method = "hmac", got ""')
    if cfg.auth.hmac_node_keys_dir and cfg.auth.method != "hmac":
        # Read only by HMAC: with MUNGE the controller never looked at it, so a site could believe each node
        # held its own key (a node's root able to speak for its own node only) when every node could sign for all.
        raise ConfigError(f"{where}: [auth].hmac_node_keys_dir: expected \"\" when [auth].method = "
                          f"{_show(cfg.auth.method)} (a key per node needs method = \"hmac\"; with MUNGE it "
                          f"would be ignored), got {_show(cfg.auth.hmac_node_keys_dir)}")
    try:
        cfg.auth.controller_uid
    except KeyError:
        # Resolved where the config is read: on each node (its hooks check answers against it) and on the head
        # node. Slurm's own rule for the SlurmUser: the same user on every host.
        raise ConfigError(f"{where}: [auth].controller_user: expected a user this host knows (a name in its passwd, "
                          f"e.g. the SlurmUser) or a uid, got {_show(cfg.auth.controller_user)}") from None
    if cfg.policy.fallback in ("rl", "rl-candidate"):
        # The fallback decides when the policy's model cannot be used: a learned one fails with it (the tick then
        # raised inside the live policy's except, and nothing was placed while the model was broken)
        raise ConfigError(f"{where}: [policy].fallback: expected a heuristic (\"frag-aware\", the best one, or "
                          f"\"first-fit\"), not a learned policy that needs a model, got {_show(cfg.policy.fallback)}")
    if cfg.policy.shadow and cfg.policy.shadow == cfg.policy.name:
        raise ConfigError(f"{where}: [policy].shadow: expected a policy other than [policy].name "
                          f"({_show(cfg.policy.name)}), got {_show(cfg.policy.shadow)}")


def parse_config_text(text: str, source: str | os.PathLike | None = None) -> Config:
    """Parse TOML text; syntax errors are reported with their line and column."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            detail = msg[: m.start()].strip()
            raise ConfigError(f"{_where(source)}: TOML syntax error at line {m.group(1)}, column {m.group(2)}: "
                              f"{detail}") from None
        raise ConfigError(f"{_where(source)}: TOML syntax error: {msg}") from None
    except ValueError as exc:  # an integer of over 4,300 digits: Python refuses to read it (int_max_str_digits)
        raise ConfigError(f"{_where(source)}: cannot read it as TOML: {str(exc).split(';')[0]}") from None
    return parse_config(data, source)


def find_config(path: str | os.PathLike | None = None) -> Path | None:
    """The file load_config() would read: ``path``, $SLURM_MIG_CONFIG, /etc/slurm-mig/slurm-mig.toml, or None."""
    if path is not None and str(path) != "":
        return Path(path)
    env = os.environ.get(ENV_VAR, "")
    if env:
        return Path(env)
    if SYSTEM_PATH.is_file():
        return SYSTEM_PATH
    return None


def check_trusted(path: str | os.PathLike | None, who: str, *, only_as_root: bool = True) -> None:
    """Refuse (ConfigError, one line naming the file and the fix) a config file that others than root and this
    process's user may change: it names the files a root process writes (``[log].file``, ``db_path``,
    ``cache_dir``), the model the controller runs, the keys it trusts and the controller the hooks obey. The rule
    is folders.writable_by_others, the one for the policy store and the rl model too: the file and every folder
    above it (as given and resolved) owned by root or by this process's user, the file writable by its owner
    only, a folder above writable by others only if sticky (as /tmp). ``who``: what refuses it ("the
    controller"); ``only_as_root``: judge only when this process runs as root (the hooks, the node tools; a
    user's own config for their own commands is theirs). None (no config file: the defaults) passes."""
    if path is None or str(path) == "" or (only_as_root and os.geteuid() != 0):
        return
    from slurm_mig.folders import writable_by_others

    problem = writable_by_others(path, "config")
    if problem:
        raise ConfigError(f"{problem}; {who} runs on what it names (files it writes, the model it runs, the "
                          f"controller and keys it trusts), so it only trusts a config only root (or its own user) "
                          f"can change (chown root, chmod go-w); nothing was done")


#: The folders of a node's own in <[node].cache_dir>/<node> (localstate.NodeState), the node's folder first.
NODE_FOLDERS = ("", "records", "bindings", "outbox", "attempts")


def written_folders(cfg: "Config", *, controller: bool = False, node: bool = False,
                    node_name: str | None = None) -> list[tuple[str, str, str]]:
    """(key, the path the config gives, the folder root writes in) of each place a root process writes that the
    config chooses: [log].file's folder; the controller's [controller].db_path folder (also its -wal, -shm and
    lock files); a node's [node].cache_dir (its node's records and layout lock are made in it) and, with the
    simulated backend, [node].sim_state_path's folder ("{node}" left as written: a folder not made yet is judged
    by those above it). With ``node_name`` (a hook, a node tool: the node it acts for) also that node's own:
    its folder in cache_dir and those in it (NODE_FOLDERS), and the simulated GPUs' folder with "{node}" that
    name. Without them a node folder, or a "{node}" folder, that exists was never judged, only cache_dir and
    the folder above "{node}": one another user owns (or anyone may write) had root keep its records there."""
    def folder_of(path: str) -> str:
        return os.path.dirname(path) or "."

    places = []
    if cfg.log.file:
        places.append(("[log].file", cfg.log.file, folder_of(cfg.log.file)))
    if controller and cfg.controller.db_path not in ("", ":memory:"):
        places.append(("[controller].db_path", cfg.controller.db_path, folder_of(cfg.controller.db_path)))
    if node:
        places.append(("[node].cache_dir", cfg.node.cache_dir, cfg.node.cache_dir))
        if node_name:
            mine = os.path.join(cfg.node.cache_dir, node_name)
            places += [("[node].cache_dir", cfg.node.cache_dir, os.path.join(mine, sub) if sub else mine)
                       for sub in NODE_FOLDERS]
        if cfg.node.nvml_backend == "simulated":
            places.append(("[node].sim_state_path", cfg.node.sim_state_path, folder_of(cfg.node.sim_state_path)))
            if node_name and "{node}" in cfg.node.sim_state_path:
                named = folder_of(cfg.node.sim_state_path.replace("{node}", node_name))
                if named != places[-1][2]:
                    places.append(("[node].sim_state_path", cfg.node.sim_state_path, named))
    return places


def check_written_folders(cfg: "Config", who: str, *, controller: bool = False, node: bool = False,
                          node_name: str | None = None, only_as_root: bool = True) -> None:
    """Refuse (ConfigError, exit 2, one line naming the key, the path and the fix) a config that has a root
    process write in a folder others may change (written_folders: the log file's, the state database's, the
    node's records' and the simulated GPUs'): one writable by its group or by anyone (sticky or not: /tmp too) or
    owned by another user, or below such a folder unless it is sticky, by the one rule, folders.writable_by_others.
    There a user could put a symbolic link where root then writes (its log appended to /etc/shadow), or rename
    the folder and put their own in its place. The check of the config itself (check_trusted) makes sure the
    paths are root's choice; this one that the folders they name stay root's. ``node_name``: the node a hook or
    node tool acts for, whose own folders are judged too (written_folders). ``only_as_root`` as there."""
    if only_as_root and os.geteuid() != 0:
        return
    from slurm_mig.folders import writable_by_others

    defaults = {"[log].file": "standard error (\"\")", "[controller].db_path": ControllerConfig.db_path,
                "[node].cache_dir": NodeConfig.cache_dir, "[node].sim_state_path": NodeConfig.sim_state_path}
    for key, path, folder in written_folders(cfg, controller=controller, node=node, node_name=node_name):
        problem = writable_by_others(folder, "folder")
        if problem:
            raise ConfigError(f"{_where(cfg.source)}: {key} = {path}: {problem}; {who} writes there, and whoever "
                              f"may change that folder could redirect what it writes (a symbolic link, a folder "
                              f"renamed): fix the folder, or choose one only root can write (the default: "
                              f"{defaults[key]}); nothing was done")


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read the configuration (see find_config for which file); the defaults if there is none.

    An explicitly named file (argument or $SLURM_MIG_CONFIG) must exist.
    """
    found = find_config(path)
    if found is None:
        return Config()
    try:
        raw = found.read_bytes()
    except FileNotFoundError:
        via = "" if path is not None and str(path) != "" else f" (from ${ENV_VAR})"
        raise ConfigError(f"config {found}{via}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config {found}: is a directory, expected a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config {found}: cannot read it: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {found}: not UTF-8 text (byte {exc.start})") from None
    return parse_config_text(text, found)


def defaults() -> Config:
    return Config()
