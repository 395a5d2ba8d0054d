"""etc/job_submit.lua: its tables match gres.py, and its rules hold (run under lua5.1).

Slurm 22.05 on Debian embeds Lua 5.1 (liblua5.1-0), so the behaviour tests run
the real script with the ``lua5.1`` interpreter and a stub ``slurm`` table.
They are skipped when no interpreter can be had; the slurm-marked tests in
tests/slurm/ run the same script inside a real slurmctld.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from slurm_mig.slurm import gres

LUA_FILE = Path(__file__).resolve().parents[1] / "etc" / "job_submit.lua"
LUA_TEXT = LUA_FILE.read_text()


def _lua_table(name: str) -> dict[str, str]:
    """Parse ``local NAME = { ["k"] = v, ... }`` from the lua file."""
    m = re.search(rf"(?ms)^local {name} = \{{(.*?)^\}}", LUA_TEXT)
    assert m, f"table {name} not found in {LUA_FILE}"
    body = m.group(1)
    pairs = re.findall(r'\[\s*"([^"]+)"\s*\]\s*=\s*("?[^",\s]+"?)\s*,', body)
    # Every non-blank, non-comment line must be an entry we parsed.
    lines = [ln for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("--")]
    assert len(lines) == len(pairs), f"unparsed lines in {name}"
    return {k: v.strip('"') for k, v in pairs}


def test_profile_table_matches_gres_py():
    assert _lua_table("PROFILE_TO_TYPE") == gres.PROFILE_TO_GRES


def test_max_per_gpu_matches_gres_py():
    assert {k: int(v) for k, v in _lua_table("MAX_PER_GPU").items()} == gres.MAX_PER_GPU


def test_max_gpus_line_is_substitutable():
    # LocalCluster rewrites exactly this line; keep it unique and plain.
    assert len(re.findall(r"(?m)^local MAX_GPUS_PER_NODE = \d+$", LUA_TEXT)) == 1


def test_profile_names_agree_with_geometry_models():
    """Every profile of slurm_mig.mig.profiles maps to the GRES type of its kind."""
    profiles = pytest.importorskip("slurm_mig.mig.profiles")
    for model in profiles.GPU_MODELS.values():
        for p in model.profiles:
            expected = gres.gres_type_for_kind(p.kind)
            if p.name in gres.AMBIGUOUS_PROFILES:
                continue  # 1g.10gb: 1g on 80GB parts, 1gdm on A100-40GB (documented choice)
            assert gres.PROFILE_TO_GRES[p.name] == expected, (model.name, p.name)


# -- behaviour, under a real Lua 5.1 ------------------------------------------------

# Slurm's side of the plugin API as job_submit.lua uses it: log_user's messages are collected per case.
FAKE_SLURM = r"""
local messages = {}
slurm = {
    SUCCESS = 0, ERROR = -1,
    log_user = function(fmt, ...) table.insert(messages, string.format(fmt, ...)) end,
    log_info = function(...) end,
    log_debug = function(...) end,
}
dofile(arg[1])
"""

HARNESS = FAKE_SLURM + r"""
for line in io.lines() do
    messages = {}
    local field, value = string.match(line, "^([%w_]+)=(.*)$")
    local desc = {}
    if value ~= "<nil>" then desc[field] = value end
    local rc = slurm_job_submit(desc, {}, 0)
    io.write(string.format("%d\t%s\t%s\n", rc, tostring(desc.tres_per_node), table.concat(messages, " | ")))
end
"""


@pytest.fixture(scope="module")
def lua(tmp_path_factory, lua51):
    exe = lua51
    script = tmp_path_factory.mktemp("lua") / "harness.lua"
    script.write_text(HARNESS)

    def run(cases: list[tuple[str, str | None]], max_gpus: int = 2) -> list[tuple[int, str, str]]:
        src = tmp_path_factory.mktemp("lua") / "job_submit.lua"
        src.write_text(re.sub(r"(?m)^local MAX_GPUS_PER_NODE = \d+", f"local MAX_GPUS_PER_NODE = {max_gpus}",
                              LUA_TEXT))
        stdin = "".join(f"{field}={'<nil>' if v is None else v}\n" for field, v in cases)
        out = subprocess.run([exe, str(script), str(src)], input=stdin, capture_output=True, text=True,
                             timeout=30, check=True).stdout
        rows = []
        for line in out.splitlines():
            rc, tres, msg = line.split("\t")
            rows.append((int(rc), tres, msg))
        assert len(rows) == len(cases)
        return rows

    return run


ACCEPTED = [
    ("gres:mig:3g", "gres:mig:3g:1"),
    ("gres:mig:3g:2", "gres:mig:3g:2"),
    ("gres:mig:1g:2", "gres:mig:1g:2"),
    ("gres:mig:3G", "gres:mig:3g:1"),
    ("gres:mig:3g.40gb", "gres:mig:3g:1"),
    ("gres:mig:1g.20gb", "gres:mig:1gdm:1"),
    ("gres:mig:1g.10gb:2", "gres:mig:1g:2"),
    ("gres:mig:1g.5gb+me", "gres:mig:1gme:1"),
    ("gres:mig:3g.71gb", "gres:mig:3g:1"),
    ("gres:mig:2g.12gb+me", "gres:mig:2gme:1"),
    ("gres:mig:1gdm:4", "gres:mig:1gdm:4"),
    ("gres:mig:7g:2", "gres:mig:7g:2"),  # 2 GPUs per node
    ("gres:mig:1g:14", "gres:mig:1g:14"),
    # later releases spell the prefix "gres/"; it is kept
    ("gres/mig:4g", "gres/mig:4g:1"),
    # --gres=gres/mig:3g: Slurm adds its own "gres:"; the controller reads the item as mig:3g
    ("gres:gres/mig:3g", "gres:gres/mig:3g:1"),
    # other GRES in the same request pass through, in order
    ("gres:mig:3g,gres:foo:1", "gres:mig:3g:1,gres:foo:1"),
    ("gres:foo:1,gres:mig:2g:2", "gres:foo:1,gres:mig:2g:2"),
    ("gres:gpu:1", "gres:gpu:1"),
    # the same type twice is merged
    ("gres:mig:1g,gres:mig:1g:2", "gres:mig:1g:3"),
    ("gres:mig:3g:0000002", "gres:mig:3g:2"),
    ("gres:mig:3g.40gb,gres:foo:1,gres:mig:3g", "gres:mig:3g:2,gres:foo:1"),
    # What Slurm 22.05's sbatch hands the script without cli_filter.lua, measured on the local cluster for
    # --gres=gres:mig:3g, mig:3g:1, mig:3g.40gb, mig:3g.40GB and mig:3g:1,mig:3g:1 (each accepted, stored as
    # below). sbatch itself refuses gres/mig:3g, gres/mig:3g:1, MIG:3g, Mig:3g and gres:MIG:3g:1 ("Invalid
    # generic resource (gres) specification"); with cli_filter.lua MIG:3g arrives as gres:mig:3g:1.
    ("gres:mig:3g.40GB", "gres:mig:3g:1"),
    ("gres:mig:3g:1,gres:mig:3g:1", "gres:mig:3g:2"),
]


def test_lua_accepts_and_rewrites(lua):
    rows = lua([("tres_per_node", src) for src, _ in ACCEPTED])
    for (src, want), (rc, got, msg) in zip(ACCEPTED, rows):
        assert (rc, got) == (0, want), (src, msg)


def test_lua_leaves_jobs_without_gres_alone(lua):
    (rc, tres, msg), = lua([("tres_per_node", None)])
    assert (rc, tres, msg) == (0, "nil", "")


REJECTED = [
    ("gres:mig:5g", "unknown MIG size '5g'"),
    ("gres:mig:8g", "unknown MIG size '8g'"),
    ("gres:mig:0g", "unknown MIG size '0g'"),
    ("gres:mig:abc", "unknown MIG size 'abc'"),
    ("gres:mig:pad", "'pad' is slurm-mig's padding, not a MIG size"),
    ("gres:mig:PAD:2", "'pad' is slurm-mig's padding, not a MIG size"),
    ("gres:mig:3g.41gb", "unknown MIG size '3g.41gb'"),
    ("gres:mig", "does not name a MIG size"),
    ("gres:mig:2", "does not name a MIG size"),
    ("gres:mig:", "does not name a MIG size"),
    ("gres:mig::2", "does not name a MIG size"),
    ("gres:mig:3g:0", "must be at least 1"),
    ("gres:mig:3g:x", "must be a whole number"),
    ("gres:mig:3g:1k", "must be a whole number"),
    ("gres:mig:3g:-1", "must be a whole number"),
    ("gres:mig:3g:1:2", "malformed"),
    ("gres:mig:3g:99", "holds at most 4 (2 per GPU x 2 GPUs)"),
    ("gres:mig:7g:3", "holds at most 2"),
    ("gres:mig:1gme:3", "holds at most 2"),
    ("gres:mig:1g:15", "holds at most 14"),
    ("gres:mig:3g:99999999999999999999", "the instance count 99999999999999999999 is more than a node can hold"),
    ("gres:mig:3g:0000000", "must be at least 1"),
    # one size per job: the controller binds a job as one size x a count
    ("gres:mig:3g,gres:mig:1g:2", "one MIG size (got mig:3g and mig:1g)"),
    ("gres:mig:4g:2,gres:mig:3g:2", "one MIG size (got mig:4g and mig:3g)"),
    ("gres:mig:1g.20gb,gres:mig:1g", "one MIG size (got mig:1gdm and mig:1g)"),
    ("gres:foo:1,gres:mig:9g", "unknown MIG size '9g'"),
    ("gres:gres/mig:3g:99", "holds at most 4"),
    ("gres:gres/mig:3g,gres:mig:1g", "one MIG size (got mig:3g and mig:1g)"),
]


def test_lua_rejects_with_message(lua):
    rows = lua([("tres_per_node", src) for src, _ in REJECTED])
    for (src, want), (rc, _tres, msg) in zip(REJECTED, rows):
        assert rc == -1, src
        assert msg.startswith("slurm-mig: "), (src, msg)
        assert want in msg, (src, msg)


def test_lua_rejects_mig_in_other_tres_fields(lua):
    (rc, _t, msg), = lua([("tres_per_task", "gres:mig:3g:1")])
    assert rc == -1 and "per node with --gres" in msg


def test_lua_max_gpus_scales_limits(lua):
    rows = lua([("tres_per_node", "gres:mig:3g:16"), ("tres_per_node", "gres:mig:3g:17")], max_gpus=8)
    assert rows[0][:2] == (0, "gres:mig:3g:16")
    assert rows[1][0] == -1 and "holds at most 16" in rows[1][2]


# -- etc/cli_filter.lua: the client-side rewrite for srun's step request ---------------------------

CLI_FILE = LUA_FILE.parent / "cli_filter.lua"


def test_cli_filter_tables_match_gres_py():
    global LUA_TEXT
    saved, LUA_TEXT = LUA_TEXT, CLI_FILE.read_text()
    try:
        assert _lua_table("PROFILE_TO_TYPE") == gres.PROFILE_TO_GRES
        assert {k: int(v) for k, v in _lua_table("MAX_PER_GPU").items()} == gres.MAX_PER_GPU
    finally:
        LUA_TEXT = saved


CLI_HARNESS = r"""
slurm = {SUCCESS = 0, ERROR = -1}
dofile(arg[1])
for line in io.lines() do
    local opts = {}
    if line ~= "<nil>" then opts["gres"] = line end
    local rc = slurm_cli_pre_submit(opts, 0)
    io.write(string.format("%d\t%s\n", rc, tostring(opts["gres"])))
end
"""

CLI_CASES = [
    ("mig:3g", "mig:3g:1"),
    ("mig:3G:2", "mig:3g:2"),
    ("mig:3g.40gb", "mig:3g:1"),
    ("mig:1g.20gb:2", "mig:1gdm:2"),
    ("gres:mig:1g", "gres:mig:1g:1"),
    ("gres/mig:7g", "gres/mig:7g:1"),
    ("mig:3g,gpu:1", "mig:3g:1,gpu:1"),
    ("gpu:a100:1", "gpu:a100:1"),
    # not understood: left for job_submit.lua to refuse with its message
    ("mig:5g", "mig:5g"),
    ("mig:2", "mig:2"),
    ("mig:3g:x", "mig:3g:x"),
    ("mig:3g:", "mig:3g:"),
    ("mig:pad", "mig:pad"),
    ("mig", "mig"),
    ("$(reboot);mig:3g", "$(reboot);mig:3g"),
    ("<nil>", "nil"),
]


def test_cli_filter_rewrites_mig_items_and_leaves_the_rest(lua51, tmp_path):
    exe = lua51
    script = tmp_path / "harness.lua"
    script.write_text(CLI_HARNESS)
    stdin = "".join(f"{src}\n" for src, _ in CLI_CASES)
    out = subprocess.run([exe, str(script), str(CLI_FILE)], input=stdin, capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert len(out) == len(CLI_CASES)
    for (src, want), line in zip(CLI_CASES, out):
        rc, got = line.split("\t")
        assert (int(rc), got) == (0, want), src


# -- slurm_job_modify: scontrol update JobId=N ... on a pending job -----------------------------------

MODIFY_HARNESS = FAKE_SLURM + r"""
-- one case a line: "desc_field=value;...|rec_field=value;..." (the record as slurmctld keeps it; unused with
-- arg[2] == "submit", which calls slurm_job_submit)
local function fields(s)
    local t = {}
    for pair in string.gmatch(s, "[^;]+") do
        local k, v = string.match(pair, "^([%w_]+)=(.*)$")
        t[k] = tonumber(v) or v
    end
    return t
end
for line in io.lines() do
    messages = {}
    local d, r = string.match(line, "^(.*)|(.*)$")
    local desc, rec = fields(d), fields(r)
    local rc
    if arg[2] == "submit" then rc = slurm_job_submit(desc, {}, 1000) else rc = slurm_job_modify(desc, rec, {}, 1000) end
    io.write(string.format("%d\t%s\t%s\n", rc, tostring(desc.tres_per_node), table.concat(messages, " | ")))
end
"""

# An update's job_desc holds only what changes: NumNodes=2 sets min_nodes (NO_VAL otherwise), Gres=... sets
# tres_per_node (nil otherwise). The record keeps the rest (max_nodes 0 = no maximum).
NO_VAL = 4294967294
MODIFY_CASES = [
    # NumNodes=2 on a pending MIG job: its instances would be split over two nodes
    (f"min_nodes=2", f"tres_per_node=gres:mig:3g:1;min_nodes=1", -1, "2 nodes were requested"),
    # Gres=mig:3g on a job submitted with --nodes=2 (and no gres)
    (f"tres_per_node=gres:mig:3g;min_nodes={NO_VAL}", "min_nodes=2", -1, "2 nodes were requested"),
    # the same updates on one-node / non-MIG jobs are fine
    (f"min_nodes=2", "tres_per_node=gres:gpu:1;min_nodes=1", 0, ""),
    (f"min_nodes=1", "tres_per_node=gres:mig:3g:1;min_nodes=2", 0, ""),
    (f"tres_per_node=gres:mig:3g;min_nodes={NO_VAL}", "min_nodes=1", 0, ""),
    (f"tres_per_node=gres:mig:3g;min_nodes=1", "min_nodes=2", 0, ""),  # both changed: the update's count wins
    # an update that touches neither gres nor node counts is never refused, even for a job queued before
    # job_submit.lua was installed with what it cannot ask for now
    (f"time_limit=10;min_nodes={NO_VAL}", "tres_per_node=gres:mig:3g:1,gres:mig:1g:1;min_nodes=2", 0, ""),
    # what a submission refuses, an update refuses
    (f"tres_per_node=gres:mig:5g", "min_nodes=1", -1, "unknown MIG size '5g'"),
    (f"tres_per_task=gres:mig:1", "tres_per_node=gres:mig:3g:1", -1, "per node with --gres"),
    # NumNodes=1-3 (a range) on a MIG job, and Gres=mig:1g on a job submitted with --nodes=1-2
    (f"min_nodes=1;max_nodes=3", "tres_per_node=gres:mig:3g:1;min_nodes=1;max_nodes=0", -1, "up to 3 nodes"),
    (f"tres_per_node=gres:mig:1g;min_nodes={NO_VAL};max_nodes={NO_VAL}", "min_nodes=1;max_nodes=2", -1,
     "up to 2 nodes"),
]


def _run_desc_cases(lua51, tmp_path, cases, mode):
    script = tmp_path / "harness.lua"
    script.write_text(MODIFY_HARNESS)
    stdin = "".join(f"{d}|{r}\n" for d, r, _, _ in cases)
    out = subprocess.run([lua51, str(script), str(LUA_FILE), mode], input=stdin, capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert len(out) == len(cases)
    for (d, r, want_rc, want_msg), line in zip(cases, out):
        rc, _tres, msg = line.split("\t")
        assert int(rc) == want_rc, (d, r, msg)
        assert want_msg in msg, (d, r, msg)
        if want_rc == -1:
            assert msg.startswith("slurm-mig: "), (d, r, msg)


def test_lua_modify_checks_the_job_as_it_will_be(lua51, tmp_path):
    _run_desc_cases(lua51, tmp_path, MODIFY_CASES, "modify")


# Submissions whose node count is more than one without min_nodes saying so. sbatch sends max_nodes only for a
# range (--nodes=2 gives min_nodes 2 and no max), NO_VAL when unset; ntasks_per_node is NO_VAL16 (65534) unset.
SUBMIT_NODE_CASES = [
    # --nodes=1-3: Slurm gives the job as many nodes of the range as it can, each with its own mig:3g
    (f"tres_per_node=gres:mig:3g;min_nodes=1;max_nodes=3", "", -1, "up to 3 nodes were requested (--nodes=1-3)"),
    # --ntasks=2 --ntasks-per-node=1: two nodes
    (f"tres_per_node=gres:mig:1g;min_nodes={NO_VAL};num_tasks=2;ntasks_per_node=1", "", -1,
     "2 tasks at most 1 per node need 2 nodes"),
    (f"tres_per_node=gres:mig:1g;num_tasks=5;ntasks_per_node=2", "", -1, "need 3 nodes"),
    # one node, however it is said
    (f"tres_per_node=gres:mig:3g;min_nodes=1;max_nodes=1", "", 0, ""),
    (f"tres_per_node=gres:mig:3g;min_nodes={NO_VAL};max_nodes={NO_VAL}", "", 0, ""),
    (f"tres_per_node=gres:mig:3g;min_nodes=1;max_nodes=0", "", 0, ""),
    (f"tres_per_node=gres:mig:1g:2;num_tasks=2;ntasks_per_node=2", "", 0, ""),
    (f"tres_per_node=gres:mig:1g:2;num_tasks=2;ntasks_per_node=65534", "", 0, ""),
    (f"tres_per_node=gres:mig:1g;num_tasks={NO_VAL};ntasks_per_node=1", "", 0, ""),
    # not MIG jobs: none of this applies
    (f"tres_per_node=gres:gpu:1;min_nodes=1;max_nodes=3", "", 0, ""),
    (f"tres_per_node=gres:amig:1;min_nodes=2", "", 0, ""),
    (f"min_nodes=2;num_tasks=4;ntasks_per_node=1", "", 0, ""),
]


def test_lua_submit_refuses_mig_jobs_that_need_several_nodes(lua51, tmp_path):
    _run_desc_cases(lua51, tmp_path, SUBMIT_NODE_CASES, "submit")


# A MIG job that names no node count is pinned to one node. Without a maximum, Slurm spreads a job over as many
# nodes as its tasks' CPUs need (sbatch -n 128 on 64-CPU nodes: two nodes, each with its own mig:1g), and
# --spread-job over as many as it can; the controller binds a job on one node only. With max_nodes 1 Slurm
# refuses such a job at submission ("Requested node configuration is not available") instead.
MAX_NODES_HARNESS = FAKE_SLURM + r"""
for line in io.lines() do
    messages = {}
    local desc = {}
    for pair in string.gmatch(line, "[^;]+") do
        local k, v = string.match(pair, "^([%w_]+)=(.*)$")
        desc[k] = tonumber(v) or v
    end
    local rc = slurm_job_submit(desc, {}, 1000)
    io.write(string.format("%d\t%s\t%s\n", rc, tostring(desc.max_nodes), table.concat(messages, " | ")))
end
"""

MAX_NODES_CASES = [
    # no node count at all (sbatch -n 128 --gres=mig:1g): pinned
    ("tres_per_node=gres:mig:1g;num_tasks=128", 0, "1"),
    (f"tres_per_node=gres:mig:3g;min_nodes={NO_VAL};max_nodes={NO_VAL}", 0, "1"),
    ("tres_per_node=gres:mig:3g.40gb:2;min_nodes=1;max_nodes=0", 0, "1"),
    ("tres_per_node=gres:gres/mig:3g;min_nodes=1", 0, "1"),
    # --nodes=1-1: already one
    ("tres_per_node=gres:mig:3g;min_nodes=1;max_nodes=1", 0, "1"),
    # not MIG jobs, or refused ones: left as they are
    (f"tres_per_node=gres:gpu:1;max_nodes={NO_VAL}", 0, str(NO_VAL)),
    ("tres_per_node=gres:amig:1;num_tasks=128", 0, "nil"),
    ("num_tasks=128", 0, "nil"),
    ("tres_per_node=gres:mig:5g", -1, "nil"),
    ("tres_per_node=gres:mig:3g;min_nodes=1;max_nodes=3", -1, "3"),
]


def test_lua_submit_pins_mig_jobs_to_one_node(lua51, tmp_path):
    script = tmp_path / "harness.lua"
    script.write_text(MAX_NODES_HARNESS)
    stdin = "".join(f"{d}\n" for d, _, _ in MAX_NODES_CASES)
    out = subprocess.run([lua51, str(script), str(LUA_FILE)], input=stdin, capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert len(out) == len(MAX_NODES_CASES)
    for (d, want_rc, want_max), line in zip(MAX_NODES_CASES, out):
        rc, max_nodes, msg = line.split("\t")
        assert (int(rc), max_nodes) == (want_rc, want_max), (d, msg)


# An update that makes a job a MIG job pins it to one node as a submission does. Measured on the local 22.05
# cluster (8-CPU nodes): "scontrol update JobId=N Gres=mig:1g" on an "sbatch -n2 --ntasks-per-node=1" job (or an
# "-n12" one) was accepted and the job ran on n[1-2]; the job record read by the script had min_nodes 1 and
# max_nodes 0 (no maximum), and no task counts. With max_nodes set to 1 an unprivileged user's update is
# accepted (NumNodes=1-1) and the job waits with BadConstraints rather than spreading. A job submitted as a MIG
# job has max_nodes 1 in its record already: its updates carry no max_nodes.
MODIFY_MAX_NODES_CASES = [
    ("tres_per_node=gres:mig:3g;min_nodes=%d" % NO_VAL, "min_nodes=1;max_nodes=0", "0", "1"),
    ("tres_per_node=gres:mig:1g", "tres_per_node=gres:foo:1;min_nodes=1;max_nodes=0", "0", "1"),
    # NumTasks=16 on a MIG job queued before the script (no maximum)
    ("num_tasks=16", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=0", "0", "1"),
    # already pinned: nothing carried
    ("tres_per_node=gres:mig:3g:2", "tres_per_node=gres:mig:3g:1;min_nodes=1;max_nodes=1", "0", "nil"),
    ("num_tasks=2", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", "0", "nil"),
    # NumNodes=1-1 says it already
    ("tres_per_node=gres:mig:1g;min_nodes=1;max_nodes=1", "min_nodes=1;max_nodes=0", "0", "1"),
    # not MIG, or not touching what counts
    ("tres_per_node=gres:gpu:1", "min_nodes=1;max_nodes=0", "0", "nil"),
    ("num_tasks=4", "tres_per_node=gres:gpu:1;min_nodes=1;max_nodes=0", "0", "nil"),
    ("time_limit=10", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=0", "0", "nil"),
]


def test_lua_modify_pins_a_job_made_mig_to_one_node(lua51, tmp_path):
    script = tmp_path / "harness.lua"
    script.write_text(MODIFY_HARNESS.replace("tostring(desc.tres_per_node)", "tostring(desc.max_nodes)"))
    stdin = "".join(f"{d}|{r}\n" for d, r, _, _ in MODIFY_MAX_NODES_CASES)
    out = subprocess.run([lua51, str(script), str(LUA_FILE), "modify"], input=stdin, capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert len(out) == len(MODIFY_MAX_NODES_CASES)
    for (d, r, want_rc, want_max), line in zip(MODIFY_MAX_NODES_CASES, out):
        rc, max_nodes, msg = line.split("\t")
        assert (rc, max_nodes) == (want_rc, want_max), (d, r, msg)


# -- mig beside Slurm's own gpu / mps / shard GRES ------------------------------------------------------------
# Each of those plugins sets CUDA_VISIBLE_DEVICES in the job, and the TaskProlog overwrote it with the MIG
# instances: the GPU Slurm allocated was hidden. The requests as job_submit.lua receives them, measured on the
# local 22.05 cluster with GresTypes=gpu,mig (Slurm accepts all of them): --gres=gpu:1,mig:1g (after cli_filter's
# rewrite) gives tres_per_node "gres:gpu:1,gres:mig:1g:1"; --gpus=1 tres_per_job "gres:gpu:1"; --gpus-per-node=1
# joins tres_per_node; --gpus-per-task=1 tres_per_task, --gpus-per-socket=1 tres_per_socket.
CUDA_GRES_SUBMIT_CASES = [
    ("tres_per_node=gres:gpu:1,gres:mig:1g:1", "", -1, "Slurm's gpu GRES, not both (got mig and gpu:1 from --gres)"),
    ("tres_per_node=gres:mig:3g,gres:gpu:1", "", -1, "gpu:1 from --gres"),
    ("tres_per_node=gres:gpu:a100:2,gres:mig:3g", "", -1, "gpu:a100:2 from --gres"),
    ("tres_per_node=gres:mig:1g:1;tres_per_job=gres:gpu:1", "", -1, "gpu:1 from --gpus"),
    ("tres_per_node=gres:mig:1g:1;tres_per_task=gres:gpu:1", "", -1, "gpu:1 from --gpus-per-task"),
    ("tres_per_node=gres:mig:1g:1;tres_per_socket=gres:gpu:1", "", -1, "gpu:1 from --gpus-per-socket"),
    ("tres_per_node=gres:mps:50,gres:mig:1g", "", -1, "Slurm's mps GRES"),
    ("tres_per_node=gres:mig:1g,gres:shard:2", "", -1, "Slurm's shard GRES"),
    ("tres_per_node=gres:GPU:1,gres:mig:1g", "", -1, "Slurm's gpu GRES"),
    # without mig, or beside GRES that set nothing, nothing changes
    ("tres_per_node=gres:gpu:1", "", 0, ""),
    ("tres_per_node=gres:gpu:1;tres_per_job=gres:gpu:2", "", 0, ""),
    ("tres_per_node=gres:gpux:1,gres:mig:1g", "", 0, ""),
    ("tres_per_node=gres:foo:1,gres:mig:3g", "", 0, ""),
    # a count of 0 allocates nothing (measured on 22.05, each accepted by Slurm and kept as written:
    # --gres=mig:1g,gpu:0 and --gpus-per-node=0 give tres_per_node "...,gres:gpu:0", --gpus=0 tres_per_job
    # "gres:gpu:0", --gpus-per-task=0 tres_per_task "gres:gpu:0"); all were refused, "hiding ... gpu:0"
    ("tres_per_node=gres:mig:1g,gres:gpu:0", "", 0, ""),
    ("tres_per_node=gres:gpu:0,gres:mig:1g:1", "", 0, ""),
    ("tres_per_node=gres:mig:1g:1;tres_per_job=gres:gpu:0", "", 0, ""),
    ("tres_per_node=gres:mig:1g:1;tres_per_task=gres:gpu:0", "", 0, ""),
    ("tres_per_node=gres:mig:1g:1;tres_per_socket=gres:gpu:0", "", 0, ""),
    ("tres_per_node=gres:gpu:a100:0,gres:mps:00,gres:shard:0,gres:mig:3g", "", 0, ""),
    ("tres_per_node=gres:gpu:0,gres:gpu:1,gres:mig:3g", "", -1, "gpu:1 from --gres"),
]


def test_lua_submit_refuses_mig_beside_slurms_gpu_gres(lua51, tmp_path):
    _run_desc_cases(lua51, tmp_path, CUDA_GRES_SUBMIT_CASES, "submit")


# Updates, measured accepted on 22.05 before: Gres=gpu:1,mig:1g:1 on a gpu job, TresPerJob=gres:gpu:1 on a MIG job.
CUDA_GRES_MODIFY_CASES = [
    ("tres_per_node=gres:gpu:1,gres:mig:1g:1", "tres_per_node=gres:gpu:1;min_nodes=1;max_nodes=0", -1,
     "gpu:1 from --gres"),
    ("tres_per_job=gres:gpu:1", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1, "gpu:1 from --gpus"),
    ("tres_per_node=gres:mig:1g", "tres_per_job=gres:gpu:1;min_nodes=1;max_nodes=0", -1, "gpu:1 from --gpus"),
    # the job leaves MIG for a whole GPU: refused, as Slurm would keep its mig:1g beside the gpu:1
    # (test_lua_modify_refuses_a_new_mig_size_of_a_queued_job)
    ("tres_per_node=gres:gpu:1", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1,
     "MIG size cannot be changed (mig:1g to no MIG instance)"),
    ("tres_per_job=gres:gpu:1", "tres_per_node=gres:foo:1;min_nodes=1;max_nodes=0", 0, ""),
    # no whole GPU asked for (a count of 0)
    ("tres_per_job=gres:gpu:0", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", 0, ""),
    ("tres_per_node=gres:mig:1g", "tres_per_job=gres:gpu:0;min_nodes=1;max_nodes=0", 0, ""),
]


def test_lua_modify_refuses_mig_beside_slurms_gpu_gres(lua51, tmp_path):
    _run_desc_cases(lua51, tmp_path, CUDA_GRES_MODIFY_CASES, "modify")


# A queued job's MIG size changed by an update. Measured on the local 22.05 cluster (demo cluster, 1 H100): Slurm
# keeps the record's old type beside the new one. A held mig:1g job updated to Gres=mig:2g (TresPerNode
# gres:mig:2g:1, what squeue shows and the controller reads) was allocated "JOB_GRES=mig:1g:1,mig:2g:1"; mig:1g
# updated to mig:3g (by its user, by root, as Gres=mig:3g:1 or TresPerNode=gres:mig:3g:1), and mig:2g to mig:3g,
# waited for ever beside an idle 3g ("node n1 lacks GRES" in slurmctld's log), as did a mig:1g job whose Gres was
# cleared (Gres=: TresPerNode "gres:"), which slurm-mig no longer saw as a MIG job. A new count of the same size
# replaces the old (mig:2g to Gres=mig:2g:2 ran with JOB_GRES=mig:2g:2), and a job without GRES made a MIG job
# (Gres=mig:3g) ran on its 3g.
MODIFY_SIZE_CASES = [
    ("tres_per_node=gres:mig:3g", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1,
     "MIG size cannot be changed (mig:1g to mig:3g)"),
    ("tres_per_node=gres:mig:3g:1", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1, "mig:1g to mig:3g"),
    ("tres_per_node=gres:mig:2g.20gb", "tres_per_node=gres:mig:3g:1;min_nodes=1;max_nodes=1", -1,
     "mig:3g to mig:2g"),
    ("tres_per_node=gres:", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1,
     "(mig:1g to no MIG instance)"),
    ("tres_per_node=gres:gres/mig:3g", "tres_per_node=gres:mig:1g:2;min_nodes=1;max_nodes=1", -1,
     "Gres=mig:1g:<count>"),
    # the same size: a new count, or said another way
    ("tres_per_node=gres:mig:2g:2", "tres_per_node=gres:mig:2g:1;min_nodes=1;max_nodes=1", 0, ""),
    ("tres_per_node=gres:mig:3g", "tres_per_node=gres:mig:3g:1;min_nodes=1;max_nodes=1", 0, ""),
    ("tres_per_node=gres:mig:3g.40gb:1", "tres_per_node=gres:mig:3g:1;min_nodes=1;max_nodes=1", 0, ""),
    # a job without MIG made one, and updates that leave GRES alone
    ("tres_per_node=gres:mig:3g", "min_nodes=1;max_nodes=0", 0, ""),
    ("time_limit=10", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", 0, ""),
    # refused for what it asks, as before
    ("tres_per_node=gres:mig:9g", "tres_per_node=gres:mig:1g:1;min_nodes=1;max_nodes=1", -1, "unknown MIG size '9g'"),
]


def test_lua_modify_refuses_a_new_mig_size_of_a_queued_job(lua51, tmp_path):
    _run_desc_cases(lua51, tmp_path, MODIFY_SIZE_CASES, "modify")
