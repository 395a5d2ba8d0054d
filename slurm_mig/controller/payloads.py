"""Checks on every field a node sends to the controller's API, before it reaches the store.

A malformed or hostile request (a bug, a compromised node) is refused with 422 naming the field, never
a 500 half-way through a handler. Requests come from root on a node; these checks keep bad data out,
they are not the authentication (see api/auth.py).
"""

from __future__ import annotations

import re

MAX_GPUS = 64  # GPU indexes 0..63 (more than any node has)
MAX_ITEMS = 1024  # list lengths; a node reports a few dozen items at most
MAX_TEXT = 256
MAX_TABLE_ERROR = 300  # characters of one table difference kept (a node cuts them so since 1083d1e)
MAX_BODY = 1 << 20  # the API server's request limit: no string in a request is longer


def rejected(message: str) -> Exception:
    from slurm_mig.api.server import RequestRejected

    return RequestRejected(message)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def v_int(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise rejected(f"{what}: expected an integer from {lo} to {hi}, got {_show(value)}")
    return value


def v_opt_int(value, what: str) -> int | None:
    return None if value is None else v_int(value, what, -(2 ** 31), 2 ** 32)


def _is_time(value) -> bool:
    """Is ``value`` a plausible time in seconds since the epoch (a number, not before 1970 nor absurdly far)?"""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1e11


def v_time(value, what: str) -> float | None:
    if value is None:
        return None
    if not _is_time(value):
        raise rejected(f"{what}: expected a time in seconds since the epoch, got {_show(value)}")
    return float(value)


_MESSAGE_ID = re.compile(r"[0-9a-f]{16,64}")


def v_message(payload: dict) -> str | None:
    """The message_id of a node message (see NodeMessage); None from an older node. Its message_at (the
    node's clock when it made the message) is checked too, though nothing here reads it."""
    message_id = payload.get("message_id")
    if message_id is not None and (not isinstance(message_id, str) or not _MESSAGE_ID.fullmatch(message_id)):
        raise rejected(f"message_id: expected 16 to 64 lowercase hex digits, got {_show(message_id)}")
    v_time(payload.get("message_at"), "message_at")
    return message_id


def v_text(value, what: str, *, optional: bool = True, max_len: int = MAX_TEXT) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > max_len or "\x00" in value:
        raise rejected(f"{what}: expected a string of at most {max_len} characters, got {_show(value)}")
    return value


def v_cut(value, what: str, max_len: int) -> str:
    """A string, cut to ``max_len`` characters (its end shown as "...") where it is longer, as a node cuts it
    since 1083d1e: nodes of c64fe4c up to it sent a table difference whole (~380 characters from a driver
    reading garbage placements), and refusing it refused the node's every report and Prolog request."""
    text = v_text(value, what, optional=False, max_len=MAX_BODY)
    return text if len(text) <= max_len else text[:max_len - 3] + "..."


def v_bool(value, what: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise rejected(f"{what}: expected true or false, got {_show(value)}")
    return value


def v_list(value, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise rejected(f"{what}: expected a list of at most {MAX_ITEMS} items, got {_show(value)}")
    return value


def v_instance(value, what: str, *, gpu: int | None = None) -> dict:
    """One MIG instance: {gpu, profile, start, uuid?, in_use?} (gpu implied inside a GPU report)."""
    if not isinstance(value, dict):
        raise rejected(f"{what}: expected an object with gpu, profile and start, got {_show(value)}")
    return {
        "gpu": gpu if gpu is not None else v_int(value.get("gpu"), f"{what}.gpu", 0, MAX_GPUS - 1),
        "profile": v_text(value.get("profile"), f"{what}.profile", optional=False, max_len=32),
        "start": v_int(value.get("start"), f"{what}.start", 0, 7),
        "uuid": v_text(value.get("uuid"), f"{what}.uuid", max_len=128),
        "in_use": v_bool(value.get("in_use"), f"{what}.in_use"),
    }


def v_foreign(value, what: str) -> dict:
    """A GPU instance of a profile the node's tables do not list: {start, size, profile_id, in_use?}."""
    if not isinstance(value, dict):
        raise rejected(f"{what}: expected an object with start, size and profile_id, got {_show(value)}")
    start = v_int(value.get("start"), f"{what}.start", 0, 7)
    return {"start": start, "size": v_int(value.get("size"), f"{what}.size", 1, 8 - start),
            "profile_id": v_int(value.get("profile_id"), f"{what}.profile_id", 0, 2 ** 32),
            "in_use": v_bool(value.get("in_use"), f"{what}.in_use")}


def v_instances(value, what: str) -> list[dict]:
    return [v_instance(v, f"{what}[{i}]") for i, v in enumerate(v_list(value, what))]


def v_observed(value) -> list[dict] | None:
    """A node's GPU report (node/context.py Node.observe()); None when the request carries none."""
    if value is None:
        return None
    out, seen = [], set()
    for n, g in enumerate(v_list(value, "observed")):
        what = f"observed[{n}]"
        if not isinstance(g, dict):
            raise rejected(f"{what}: expected an object describing a GPU, got {_show(g)}")
        index = v_int(g.get("index"), f"{what}.index", 0, MAX_GPUS - 1)
        if index in seen:
            raise rejected(f"{what}.index: GPU {index} is reported twice")
        seen.add(index)
        model = v_text(g.get("model"), f"{what}.model", max_len=64)
        entry = {"index": index, "uuid": v_text(g.get("uuid"), f"{what}.uuid", max_len=128),
                 "name": v_text(g.get("name"), f"{what}.name"), "model": model,
                 "mig_enabled": v_bool(g.get("mig_enabled"), f"{what}.mig_enabled"),
                 "lost": v_bool(g.get("lost"), f"{what}.lost"),
                 # the MIG mode a change waiting for a GPU reset will set; absent (None): none waits
                 "mig_pending": None if g.get("mig_pending") is None else v_bool(g.get("mig_pending"),
                                                                                   f"{what}.mig_pending"),
                 "instances": [v_instance(i, f"{what}.instances[{k}]", gpu=index)
                               for k, i in enumerate(v_list(g.get("instances"), f"{what}.instances"))],
                 "foreign": [v_foreign(f, f"{what}.foreign[{k}]")
                             for k, f in enumerate(v_list(g.get("foreign"), f"{what}.foreign"))],
                 # where the node's driver disagrees with our MIG table for this GPU (Node.table_errors)
                 "table_errors": [v_cut(e, f"{what}.table_errors[{k}]", MAX_TABLE_ERROR)
                                  for k, e in enumerate(v_list(g.get("table_errors"), f"{what}.table_errors"))]}
        if len(entry["table_errors"]) > 16:
            raise rejected(f"{what}.table_errors: at most 16, got {len(entry['table_errors'])}")
        if len({(i["start"]) for i in entry["instances"]}) != len(entry["instances"]):
            raise rejected(f"{what}: two instances at one start")
        # A model our tables do not list (a node newer than this controller, during a rolling upgrade), none
        # named with instances on the GPU, or instances a known model's table does not allow (a newer node's
        # profile, placement or count: store.models.off_table): the rest of the report is taken, and this GPU is
        # kept as it is (store: ObservedGpu.blocked, readable_model None: left out of the policy's view, of the
        # GRES and of every binding chosen here). Refusing the whole report refused every report and Prolog of
        # the node for the whole upgrade (a profile or placement our table lacks: until 2026-11-27).
        out.append(entry)
    return out


def v_bindings(value) -> dict[str, list[dict]]:
    """The node's binding files: job id -> instances (keys that are not job ids are kept: they still hold slices)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise rejected(f"bindings: expected an object of job id -> instances, got {_show(value)}")
    out = {}
    for job_id, insts in value.items():
        v_text(job_id, "bindings key", optional=False, max_len=64)
        out[job_id] = v_instances(insts, f"bindings[{job_id!r}]")
    return out


def v_binding_times(value) -> dict[str, float]:
    """When the node wrote each binding file (its clock): job id -> time; {} from an older node."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise rejected(f"binding_times: expected an object of job id -> time, got {_show(value)}")
    out = {}
    for job_id, at in value.items():
        v_text(job_id, "binding_times key", optional=False, max_len=64)
        # A file time is advice (whether a binding file predates the job's current run): one that is not a
        # plausible time (a file touched to 1969, a clock far off) counts as unknown, as from an older node,
        # rather than refusing the whole report, which holds the node's GPUs and bindings.
        if _is_time(at):
            out[job_id] = float(at)
    return out


def v_results(value, *, need_gpu: bool) -> list[dict]:
    """Layout-change results from a node (nvml.apply.ApplyResult.to_json(), or a failure), as plain text fields."""
    def text(v) -> str | None:
        return None if v is None else str(v)[:2000]

    out = []
    for n, r in enumerate(v_list(value, "results")):
        if not isinstance(r, dict):
            raise rejected(f"results[{n}]: expected an object, got {_show(r)}")
        gpu = r.get("gpu")
        out.append({"gpu": v_int(gpu, f"results[{n}].gpu", 0, MAX_GPUS - 1) if need_gpu or gpu is not None else None,
                    "ok": bool(r.get("ok")), "reached": bool(r.get("reached", True)),
                    "before": text(r.get("before")), "after": text(r.get("after")), "done": text(r.get("done")),
                    "error": text(r.get("error"))})
    return out
