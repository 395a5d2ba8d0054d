"""Fuzzing etc/job_submit.lua under a real Lua 5.1 (the Lua Slurm 22.05 embeds on Debian).

Hypothesis generates hostile job descriptions (GRES strings built from real and broken pieces,
shell metacharacters, unicode, NUL bytes, very long strings, huge counts, odd min_nodes, mig in
the other tres fields, hostile names and comments) and the script must, for each:

* never raise a Lua error (slurmctld would reject the job with no message, and log a trace);
* either accept it, with every mig item rewritten to ``mig:<type>:<count>`` for a known type and a
  count a node can hold, and every other item passed through unchanged, or refuse it with one
  ``slurm-mig: ...`` message for the user;
* never touch any field but tres_per_node, and max_nodes (set to 1) of an accepted MIG job.

All cases of one hypothesis run go through one lua5.1 process (hex-encoded, one per line).
Examples: ``SLURM_MIG_FUZZ_EXAMPLES`` (default 150) x 20 cases each.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_mig.slurm import gres, parsers

LUA_TEXT = (Path(__file__).resolve().parents[1] / "etc" / "job_submit.lua").read_text()
EXAMPLES = int(os.environ.get("SLURM_MIG_FUZZ_EXAMPLES", "150"))
CASES_PER_EXAMPLE = 20
MAX_GPUS = 2

HARNESS = r"""
local messages = {}
local function unhex(s) return (s:gsub("..", function(h) return string.char(tonumber(h, 16)) end)) end
local function hex(s) return (s:gsub(".", function(c) return string.format("%02x", string.byte(c)) end)) end
slurm = {
    SUCCESS = 0, ERROR = -1,
    log_user = function(fmt, ...) table.insert(messages, string.format(fmt, ...)) end,
    log_info = function(fmt, ...) string.format(fmt, ...) end,
    log_debug = function(...) end,
}
dofile(arg[1])
local FIELDS = { "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task", "min_nodes", "max_nodes",
                 "name", "comment", "admin_comment" }
for line in io.lines() do
    messages = {}
    local desc, before = {}, {}
    for pair in string.gmatch(line, "[^\t]+") do
        local k, v = string.match(pair, "^([%w_]+)=(%x*)$")
        desc[k] = unhex(v)
    end
    for _, f in ipairs(FIELDS) do before[f] = desc[f] end
    local ok, rc = pcall(slurm_job_submit, desc, {}, 1000)
    if not ok then
        io.write("LUAERROR\t" .. hex(tostring(rc)) .. "\n")
    else
        local changed = {}
        for _, f in ipairs(FIELDS) do
            if f ~= "tres_per_node" and desc[f] ~= before[f] then
                table.insert(changed, f == "max_nodes" and "max_nodes=" .. tostring(desc[f]) or f)
            end
        end
        io.write(string.format("%d\t%s\t%s\t%d\t%s\n", rc, hex(tostring(desc.tres_per_node)),
            hex(table.concat(messages, " | ")), #messages, table.concat(changed, ",")))
    end
end
"""


@pytest.fixture(scope="module")
def lua(tmp_path_factory, lua51):
    exe = lua51
    d = tmp_path_factory.mktemp("lua-fuzz")
    (d / "harness.lua").write_text(HARNESS)
    (d / "job_submit.lua").write_text(re.sub(r"(?m)^local MAX_GPUS_PER_NODE = \d+",
                                             f"local MAX_GPUS_PER_NODE = {MAX_GPUS}", LUA_TEXT))

    def run(cases: list[dict[str, bytes]]) -> list[tuple]:
        stdin = "".join("\t".join(f"{k}={v.hex()}" for k, v in c.items()) + "\n" for c in cases)
        res = subprocess.run([exe, str(d / "harness.lua"), str(d / "job_submit.lua")], input=stdin.encode(),
                             capture_output=True, timeout=60)
        assert res.returncode == 0, res.stderr.decode(errors="replace")
        rows = []
        for line in res.stdout.decode().splitlines():
            parts = line.split("\t")
            if parts[0] == "LUAERROR":
                rows.append(("LUAERROR", bytes.fromhex(parts[1]).decode(errors="replace")))
            else:
                rows.append((int(parts[0]), bytes.fromhex(parts[1]).decode("latin-1"),
                             bytes.fromhex(parts[2]).decode("latin-1"), int(parts[3]),
                             parts[4] if len(parts) > 4 else ""))
        assert len(rows) == len(cases)
        return rows

    return run


SIZES = ["1g", "2g", "3g", "4g", "7g", "1gdm", "1gme", "2gme", "3G", "1g.10gb", "3g.40gb", "1g.5gb+me",
         "7g.141gb", "5g", "0g", "8g", "abc", "", "3g.41gb", "1g.10gb+me", "３g", "3g\x00", "3g;id"]
COUNTS = ["", "1", "2", "0", "-1", "99", "999999999999999999999999", "1e3", "0x2", "1.5", " 1", "1 ", "١", "2"]
HOSTILE = [b"$(reboot)", b"`id`", b"; rm -rf /", b"a\nb", b"\x00", "ñ☃\u202e".encode(), b"%s%n%d", b"\\",
           b"\xff\xfe", b"'\"", b"A" * 10_000, b"mig", b"gres:mig:3g:1", b"%", b"%%", b"[[", b"]]"]

item = st.one_of(
    st.builds(lambda pre, size, cnt: f"{pre}mig:{size}" + (f":{cnt}" if cnt else ""),
              st.sampled_from(["gres:", "gres/", "", "GRES:", "gres:gres/"]), st.sampled_from(SIZES),
              st.sampled_from(COUNTS)),
    st.sampled_from(["gres:gpu:1", "gres:foo:2", "gres:mig", "gres:mig:", "gres:mig::2", "gres:MIG:3g",
                     "gres:mig:3g:1:2", "gres:mig:2", "license:x:1"]),
    st.text(max_size=15),
)
tres = st.lists(item, min_size=0, max_size=4).map(",".join).map(str.encode) | st.sampled_from(HOSTILE)
case = st.fixed_dictionaries({"tres_per_node": tres}, optional={
    "min_nodes": st.sampled_from([b"1", b"2", b"0", b"4294967294", b"-1", b"x", b"1e9"]),
    "tres_per_task": tres, "tres_per_job": tres, "tres_per_socket": tres,
    "name": st.sampled_from(HOSTILE) | st.binary(max_size=30), "comment": st.sampled_from(HOSTILE),
})

# Counted across the run, for docs/reliability.md.
TRIED = {"cases": 0, "accepted": 0, "refused": 0}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])
@given(cases=st.lists(case, min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE))
def test_job_submit_lua_never_errors_and_rewrites_or_refuses(lua, cases):
    rows = lua(cases)
    for c, row in zip(cases, rows):
        assert row[0] != "LUAERROR", (c, row[1])
        rc, new, msg, n_messages, changed = row
        TRIED["cases"] += 1
        if rc == 0 and any(_name(i) == "mig" for i in _items(c["tres_per_node"].decode("latin-1"))):
            # an accepted MIG job without a maximum node count is pinned to one node
            assert changed in ("", "max_nodes=1"), f"the script changed {changed} for {c}"
        else:
            assert changed == "", f"the script changed {changed} for {c}"
        if rc == 0:
            TRIED["accepted"] += 1
            assert n_messages == 0, (c, msg)
            _check_accepted(c["tres_per_node"].decode("latin-1"), new, c)
        else:
            TRIED["refused"] += 1
            assert rc == -1 and n_messages == 1 and msg.startswith("slurm-mig: "), (c, rc, msg)


def _check_accepted(old: str, new: str, case: dict) -> None:
    if not any(_name(i) == "mig" for i in _items(old)):
        assert new == (old if case["tres_per_node"] else ""), (old, new)  # untouched
        return
    if "(" in new or ")" in new:
        # Python's split_gres keeps commas inside parentheses together, Lua splits on every comma: the two
        # disagree on "(,gres:mig:1g". Slurm refuses such a string anyway; see docs/reliability.md.
        return
    req = parsers.mig_request(new)
    assert len(req) == 1, (old, new)  # one size per job
    slices = 0
    for gtype, n in req.items():
        assert gtype in gres.GRES_TYPES, (old, new)
        assert 1 <= n <= gres.MAX_PER_GPU[gtype] * MAX_GPUS, (old, new)
        slices += n * gres.COMPUTE_SLICES[gtype]
    assert slices <= 7 * MAX_GPUS, (old, new)
    # Whitespace-only items come back as empty ones ("mig:1g, " -> "mig:1g:1,"): noted in docs/reliability.md.
    kept = [i for i in new.split(",") if i and not re.fullmatch(r"(gres[:/]|gres:gres/)?mig:[a-z0-9]+:\d+", i)]
    assert kept == [i for i in _items(old) if _name(i) != "mig"], (old, new)
    nodes = case.get("min_nodes", b"1")
    assert not (nodes.isdigit() and 1 < int(nodes) < 4294967294), (old, case)


LUA_SPACE = " \t\n\v\f\r"  # Lua's %s in the C locale (Python's strip() also takes \x1c-\x1f)


def _items(value: str) -> list[str]:
    return [i.strip(LUA_SPACE) for i in value.split(",") if i.strip(LUA_SPACE)]


def _name(item: str) -> str:
    # as parse_gres_item strips them: "gres:" then "gres/" ("gres:gres/mig:3g" from --gres=gres/mig:3g)
    body = re.sub(r"^gres/", "", re.sub(r"^gres:", "", item.strip(LUA_SPACE)))
    return body.split(":", 1)[0].lower()


def test_counts_reported(lua):
    # Runs after the fuzz test in file order; prints the totals for docs/reliability.md (-s to see).
    print(f"\njob_submit.lua fuzz: {TRIED['cases']} job descriptions, {TRIED['accepted']} accepted, "
          f"{TRIED['refused']} refused, 0 Lua errors")
