"""The admin/user/operator docs cannot drift from the code: commands, keys, metrics, files, links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from slurm_mig.cli import build_parser
from slurm_mig.config import RULES

ROOT = Path(__file__).resolve().parents[1]
# configuration.md is checked on its own (its error examples name a misspelt key on purpose); rl-policy.md is not
# an admin's (the RL work's own document).
DOCS = ["admin-guide.md", "user-guide.md", "operator-guide.md", "architecture.md", "metrics.md",
        "failure-modes.md", "security.md", "node-channel.md", "hardware-checks.md", "reliability.md",
        "performance.md", "benchmarks.md"]


def text(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def commands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


@pytest.mark.parametrize("doc", DOCS)
def test_every_slurm_mig_command_in_the_docs_exists(doc):
    known = commands()
    # invocations: `slurm-mig x`, "$ slurm-mig x", ".../bin/slurm-mig x" (prose like "slurm-mig never" is not one)
    used = set(re.findall(r"(?:`|\$ |/bin/)slurm-mig (?:--config \S+ )?([a-z][a-z-]+)", text(doc)))
    missing = used - known
    assert not missing, f"{doc} names slurm-mig commands that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS + ["../README.md"])
def test_config_keys_in_the_docs_exist(doc):
    # "[node].cache_dir", and "[controller] hold_reserved" as some prose writes it (the README's "[node] backend"
    # named no key: it is nvml_backend)
    sections = "|".join(RULES)
    for section, key in re.findall(rf"\[({sections})\](?:\.| `?)([a-z_]+)", text(doc)):
        assert key in RULES[section], f"{doc}: [{section}].{key} is not a config key"
    for section, key in re.findall(r"\[([a-z]+)\]\.([a-z_]+)", text(doc)):
        assert section in RULES and key in RULES[section], f"{doc}: [{section}].{key} is not a config key"


@pytest.mark.parametrize("doc", DOCS)
def test_files_and_links_in_the_docs_exist(doc):
    t = text(doc)
    for path in re.findall(r"`((?:etc|prolog|epilog|tests|slurm_mig)/[A-Za-z0-9_][A-Za-z0-9_./-]*)`", t):
        assert (ROOT / path.rstrip("/")).exists(), f"{doc} names {path}, which does not exist"
    for link in re.findall(r"\]\(([A-Za-z0-9_.-]+\.md)\)", t):
        assert (ROOT / "docs" / link).exists(), f"{doc} links to {link}, which does not exist"


def code_metrics() -> set[str]:
    names = set()
    for path in list((ROOT / "slurm_mig" / "controller").glob("*.py")) + list((ROOT / "slurm_mig" / "api").glob("*.py")):
        names |= set(re.findall(r'"(slurm_mig_[a-z_]+)"', path.read_text()))
    return names


def test_metrics_doc_lists_exactly_the_controllers_series():
    documented = set(re.findall(r"^\| `(slurm_mig_[a-z_]+)` \|", text("metrics.md"), re.M))
    assert documented == code_metrics(), (
        f"only in docs/metrics.md: {sorted(documented - code_metrics())}; "
        f"only in the code: {sorted(code_metrics() - documented)}")
    # every PromQL example uses documented series (histograms through _bucket/_sum/_count)
    used = set(re.findall(r"(slurm_mig_[a-z_]+)", text("metrics.md")))
    base = {re.sub(r"_(bucket|sum|count)$", "", u) for u in used}
    assert base <= documented, sorted(base - documented)


def test_screen_captures_in_the_docs_are_80_columns():
    t = text("operator-guide.md")
    block = t.split("What the demo cluster looks like in an 80x24 terminal", 1)[1].split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)


# One submission per `slurm-mig: ...` row of the user guide's "At submission" table (a job_submit.lua
# description, with the largest node of 8 GPUs the guide's numbers assume).
SUBMISSIONS = [
    {"tres_per_node": "gres:mig:5g"},
    {"tres_per_node": "gres:mig"},
    {"tres_per_node": "gres:mig:3g:1:x"},
    {"tres_per_node": "gres:mig:3g:x"},
    {"tres_per_node": "gres:mig:3g:0"},
    {"tres_per_node": "gres:mig:3g:17"},
    {"tres_per_node": "gres:mig:3g,gres:mig:1g:2"},
    {"tres_per_node": "gres:mig:3g:9999999"},
    {"tres_per_node": "gres:mig:pad"},
    {"tres_per_task": "gres:mig:1"},
    {"tres_per_node": "gres:gpu:1,gres:mig:1g:1"},
    {"tres_per_node": "gres:mig:3g", "min_nodes": "2"},
    {"tres_per_node": "gres:mig:3g", "min_nodes": "1", "max_nodes": "3"},
]

SUBMIT_HARNESS = r"""
local messages = {}
slurm = { SUCCESS = 0, ERROR = -1, log_info = function(...) end, log_debug = function(...) end,
          log_user = function(fmt, ...) table.insert(messages, string.format(fmt, ...)) end }
dofile(arg[1])
for line in io.lines() do
    messages = {}
    local desc = {}
    for k, v in string.gmatch(line, "([%w_]+)=([^\t]*)") do desc[k] = v end
    slurm_job_submit(desc, {}, 1000)
    io.write(table.concat(messages, " | ") .. "\n")
end
"""


def test_user_guide_submission_messages_are_what_job_submit_lua_prints(tmp_path, lua51):
    import subprocess

    section = text("user-guide.md").split("### At submission", 1)[1].split("\n### ", 1)[0]
    quoted = re.findall(r"^\| `(slurm-mig: [^`]+)`", section, re.M)
    assert len(quoted) == len(SUBMISSIONS), "one SUBMISSIONS entry per quoted message"
    lua = re.sub(r"(?m)^local MAX_GPUS_PER_NODE = \d+", "local MAX_GPUS_PER_NODE = 8",
                 (ROOT / "etc" / "job_submit.lua").read_text())
    (tmp_path / "job_submit.lua").write_text(lua)
    (tmp_path / "harness.lua").write_text(SUBMIT_HARNESS)
    stdin = "".join("\t".join(f"{k}={v}" for k, v in d.items()) + "\n" for d in SUBMISSIONS)
    printed = subprocess.run([lua51, str(tmp_path / "harness.lua"), str(tmp_path / "job_submit.lua")],
                             input=stdin, capture_output=True, text=True, timeout=30,
                             check=True).stdout.splitlines()
    for doc, desc, got in zip(quoted, SUBMISSIONS, printed):
        # "..." in the guide stands for the rest of the message (the usage hint, a field's value)
        pattern = ".*".join(re.escape(part) for part in doc.split("..."))
        assert re.fullmatch(pattern, got), f"user guide says {doc!r}; job_submit.lua prints {got!r} for {desc}"


def test_configuration_doc_lists_every_key_with_its_default():
    # docs/configuration.md is not in DOCS (its error examples name a misspelt key on purpose), so
    # nothing checked its tables against the code.
    import tomllib

    from slurm_mig.config import Config

    cfg = Config()
    seen = set()
    for part in re.split(r"(?m)^## ", text("configuration.md"))[1:]:
        m = re.match(r"`\[(\w+)\]`", part)
        if not m:
            continue
        section = m.group(1)
        rows = re.findall(r"(?m)^\| `(\w+)` \| `([^`]*)` \| (.*) \|$", part)
        assert [k for k, _, _ in rows] == list(RULES[section]), f"[{section}] table and config.RULES differ"
        for key, shown, meaning in rows:
            value = getattr(getattr(cfg, section), key)
            value = list(value) if isinstance(value, tuple) else value
            assert tomllib.loads(f"v = {shown}")["v"] == value, f"[{section}].{key}: doc says {shown}, code {value!r}"
            for bound in documented_bounds(RULES[section][key]):
                assert bound in meaning, f"[{section}].{key}: the doc does not give its bound {bound!r}"
        seen.add(section)
    assert seen == set(RULES)


def documented_bounds(check) -> list[str]:
    """How a key's bounds read in docs/configuration.md, from what its check expects: "> 0", ">= 1",
    "1-65535" (a range), or each choice quoted (the upper time bounds are said once, above the tables)."""
    from slurm_mig.config import _Bad

    try:
        check(object())
    except _Bad as bad:
        want = str(bad)
    m = re.fullmatch(r"an? (?:number|integer) (>=?) (\S+)(?: and <= (\S+))?", want)
    if m:
        return [f"{m.group(2)}-{m.group(3)}" if m.group(3) else f"{m.group(1)} {m.group(2)}"]
    m = re.fullmatch(r"one of (.*)", want)
    if m:
        return [o.strip('"') for o in m.group(1).split(", ")]
    return []


def test_readme_commands_exist():
    used = set(re.findall(r"(?:`|\$ |/bin/)slurm-mig (?:--config \S+ )?([a-z][a-z-]+)",
                          (ROOT / "README.md").read_text()))
    assert used and not used - commands()


def _code_snippets(t: str) -> list[str]:
    """What a reader would type: each line of a fenced block (a trailing backslash joins the next) and each
    `code span` of the prose."""
    snippets = []
    for i, part in enumerate(re.split(r"(?m)^\s*```.*$", t)):
        if i % 2:
            snippets += part.replace("\\\n", " ").splitlines()
        else:
            snippets += re.findall(r"`([^`\n]+)`", part)
    return snippets


def _subparsers(parser):
    return next((a.choices for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)


@pytest.mark.parametrize("doc", DOCS + ["configuration.md", "../README.md"])
def test_every_flag_the_docs_give_a_slurm_mig_command_is_one_it_takes(doc):
    # `slurm-mig nodes [--node gpu0[1-4]]`, `slurm-mig nvml apply --gpu 0 ... --dry-run`: each --flag after a
    # command (up to a # comment) must be one of that (sub)command's options, spelt out (not an abbreviation).
    root = build_parser()
    wrong = []
    for snippet in _code_snippets(text(doc)):
        for m in re.finditer(r"(?:^|[\s/$])slurm-mig((?:\s+\S+)+)", snippet):
            words = m.group(1).split()
            if words[:1] == ["--config"]:
                words = words[2:]
            parser, path = root, []
            while words and (_subparsers(parser) or {}).get(words[0]) is not None:
                parser, path = _subparsers(parser)[words[0]], path + [words.pop(0)]
            if not path:
                continue
            known = {s for a in parser._actions for s in a.option_strings}
            for w in words:
                if w.startswith("#"):
                    break
                flag = re.match(r"[\[(|]*(--[a-z][a-z-]*)", w)
                if flag and flag.group(1) not in known:
                    wrong.append(f"slurm-mig {' '.join(path)} {flag.group(1)}")
    assert not wrong, f"{doc} gives flags these commands do not take: {sorted(set(wrong))}"


def _code_series() -> dict[str, tuple[str, frozenset, tuple]]:
    """Each series the controller exports: name -> (type, label names, histogram buckets), read from its calls
    metrics.inc (a counter), .set (a gauge) and .observe (a histogram, with its buckets)."""
    kinds = {"inc": "counter", "set": "gauge", "observe": "histogram"}
    found: dict[str, set] = {}
    for path in list((ROOT / "slurm_mig" / "controller").glob("*.py")) + list((ROOT / "slurm_mig" / "api").glob("*.py")):
        src = path.read_text()
        for m in re.finditer(r'metrics\.(inc|set|observe)\(\s*"(slurm_mig_[a-z_]+)"', src):
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                i += 1
            args = src[m.end():i - 1]
            labels = frozenset(re.findall(r'\(\s*"([a-z_]+)"\s*,', args))
            buckets = ()
            if m.group(1) == "observe":
                buckets = tuple(float(b) for b in re.findall(r"[\d.]+", args.rsplit("(", 1)[1]))
            found.setdefault(m.group(2), set()).add((kinds[m.group(1)], labels, buckets))
    for name, forms in found.items():
        assert len(forms) == 1, f"{name} is exported in more than one form: {forms}"
    return {name: next(iter(forms)) for name, forms in found.items()}


def _doc_buckets(meaning: str) -> tuple:
    m = re.search(r"Buckets ([^.]+(?:\.\d[^.]*)*)\.(?:\s|$)", meaning)
    if not m:
        return ()
    # "Buckets 1 ms, 10 ms, 100 ms, 0.5, 1, 5 s.": a bare number is in seconds
    return tuple(float(part.split()[0]) / (1000 if part.endswith(" ms") else 1) for part in m.group(1).split(", "))


def test_metrics_doc_gives_each_series_its_exported_type_labels_and_buckets():
    # The names were checked (above); an admin's PromQL also needs the type (rate() of a gauge, a histogram
    # read without _bucket), the label names (sum by (kind)) and a histogram's buckets (histogram_quantile).
    code = _code_series()
    rows = re.findall(r"^\| `(slurm_mig_[a-z_]+)` \| (\w+) \|([^|]*)\| (.*) \|$", text("metrics.md"), re.M)
    assert {r[0] for r in rows} == set(code)
    for name, kind, labels, meaning in rows:
        want_kind, want_labels, want_buckets = code[name]
        assert kind == want_kind, f"docs/metrics.md: {name} is a {kind}; the controller exports a {want_kind}"
        assert frozenset(re.findall(r"`([a-z_]+)`", labels)) == want_labels, (
            f"docs/metrics.md: {name} labels {labels.strip()!r}; the controller's: {sorted(want_labels)}")
        if want_kind == "histogram":
            assert _doc_buckets(meaning) == want_buckets, (
                f"docs/metrics.md: {name} buckets {_doc_buckets(meaning)}; the controller's: {want_buckets}")


def test_the_example_node_lines_are_counts_of_the_layouts_they_name():
    """The Gres= examples an admin copies into slurm.conf: "2 H100s each split as 3g+2g+1g+1g" must be a
    layout an H100 has (that one is 2g@0,1g@2,1g@3,3g@4), and the line its counts on every GPU, padded to 7 per
    GPU: a wrong pad drains the node at its next registration while a job holds an instance."""
    from collections import Counter

    from slurm_mig.mig.layout import iter_valid_layouts
    from slurm_mig.mig.profiles import get_model
    from slurm_mig.slurm.gres import gres_type_for_kind

    model = get_model("H100-80GB")
    legal = {frozenset(Counter(gres_type_for_kind(layout.profile_of(s).kind) for s in layout.slots).items())
             for layout in iter_valid_layouts(model)}
    sources = {"etc/slurm.conf.snippet": (ROOT / "etc" / "slurm.conf.snippet").read_text(),
               "docs/admin-guide.md": text("admin-guide.md")}
    checked = 0
    for where, t in sources.items():
        for m in re.finditer(r"(\d+|two) H100s each (?:split|carved) (?:as )?([0-9a-z+]+)[^\n]*\n(?:.*\n)*?.*?"
                             r"NodeName=\S+ Gres=(\S+)", t):
            gpus, named, gres = 2 if m.group(1) == "two" else int(m.group(1)), m.group(2), m.group(3)
            per_gpu = Counter(named.split("+"))
            assert frozenset(per_gpu.items()) in legal, f"{where}: no {model.name} layout is {named}"
            counts = {k: int(n) for k, n in (item.split(":")[1:] for item in gres.split(","))}
            pad = counts.pop("pad")
            assert {k: n for k, n in counts.items() if n} == {k: n * gpus for k, n in per_gpu.items()}, (
                f"{where}: Gres={gres} is not {gpus} x {named}")
            assert sum(counts.values()) + pad == 7 * gpus, f"{where}: mig:pad:{pad} does not make 7 per GPU"
            checked += 1
    assert checked == 2


def test_the_capacity_placeholder_example_advertises_every_type_at_its_most_per_gpu_times_8():
    # "Counts below: per GPU maximum x 8 GPUs" (the snippet), matching job_submit.lua's MAX_GPUS_PER_NODE = 8:
    # a type missing or short here is refused at submission ("Requested node configuration is not available").
    from slurm_mig.slurm.gres import GRES_TYPES, MAX_PER_GPU

    line = re.search(r"NodeName=migcapacity .* Gres=(\S+)", (ROOT / "etc" / "slurm.conf.snippet").read_text())
    counts = {k: int(n) for k, n in (item.split(":")[1:] for item in line.group(1).split(","))}
    assert counts == {t: MAX_PER_GPU[t] * 8 for t in GRES_TYPES}
    assert re.search(r"(?m)^local MAX_GPUS_PER_NODE = 8$", (ROOT / "etc" / "job_submit.lua").read_text())


def test_nvml_backend_help_names_the_config_key_the_default_comes_from(tmp_path, monkeypatch):
    # `nvml show` with neither --backend nor a sim state uses the config's [node].nvml_backend (what the hooks
    # use); its help said "else real", so an admin reading it on a node configured "simulated" expected NVML.
    from slurm_mig.nvml.cli import backend_settings

    for name in ("SLURM_MIG_NVML_BACKEND", "SLURM_MIG_SIM_STATE", "SLURM_MIG_SIM_DELAY_SCALE"):
        monkeypatch.delenv(name, raising=False)
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[node]\nnvml_backend = "simulated"\nsim_state_path = "{tmp_path}/gpus.json"\n')
    args = build_parser().parse_args(["--config", str(cfg), "nvml", "show"])
    assert backend_settings(args)["kind"] == "simulated"
    nvml = _subparsers(build_parser())["nvml"]
    for name, parser in _subparsers(nvml).items():
        help_ = next(a.help for a in parser._actions if "--backend" in a.option_strings)
        assert "[node].nvml_backend" in help_, f"slurm-mig nvml {name} --backend: {help_!r}"


def test_every_policy_an_admin_can_name_is_listed_where_the_name_is_set():
    # etc/slurm-mig.toml's [policy].name comment listed five of the seven (no rl, rl-candidate)
    from slurm_mig.policies import policy_names

    toml = (ROOT / "etc" / "slurm-mig.toml").read_text().split("[policy]", 1)[1].split("\nname =", 1)[0]
    row = re.search(r"(?m)^\| `name` \|.*$", text("configuration.md").split("## `[policy]`", 1)[1]).group(0)
    for where, t in (("etc/slurm-mig.toml", toml), ("docs/configuration.md", row)):
        missing = [n for n in policy_names() if f'"{n}"' not in t]
        assert not missing, f"{where} does not list the policies {missing}"


def test_the_snippet_the_admin_guide_describes_and_its_hook_paths_are_install_hooks_defaults():
    # Step 5.1 lists what the snippet sets (it left out CliFilterPlugins=lua, which fails every sbatch on a host
    # without cli_filter.lua); the hook paths are where `install-hooks` writes with its default --prefix.
    from slurm_mig.node.cli import HOOKS

    snippet = (ROOT / "etc" / "slurm.conf.snippet").read_text()
    settings = dict(re.findall(r"(?m)^(\w+)=(\S+)$", snippet))
    step = text("admin-guide.md").split("1. Add the lines of `etc/slurm.conf.snippet`", 1)[1].split("\n2. ", 1)[0]
    step = " ".join(step.split())
    for key, value in settings.items():
        if key in ("Prolog", "Epilog", "TaskProlog"):
            assert "the three hooks" in step
        else:
            assert f"`{key}={value}`" in step, f"admin guide step 5.1 does not say the snippet sets {key}={value}"
    prefix = next(a.default for a in _subparsers(build_parser())["install-hooks"]._actions if "--prefix" in a.option_strings)
    hooks = {settings["Prolog"], settings["Epilog"], settings["TaskProlog"],
             re.search(r"HealthCheckProgram=(\S+)", snippet).group(1)}
    assert hooks == {f"{prefix}/{name}" for name in HOOKS}


def test_the_operator_guide_lists_the_fields_of_jobs_json():
    from slurm_mig.ops.views import job_dict
    from slurm_mig.store.models import Job

    part = text("operator-guide.md").split("With `--json`, a list of objects, one per job", 1)[1]
    part = part.split("A job requeued while it ran", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", part)) - {"explain"}  # "(`explain` says which run ...)"
    fields = set(job_dict(Job(job_id="1", user="u", name="n", partition="p", profile="1g", count=1, time_limit_s=None,
                                 state="PENDING", reason="", submit_time=0.0, start_time=None, end_time=None, node=None,
                                 instances=(), priority_order=None, exit_code=None, updated_at=0.0), 0.0))
    assert documented == fields, (f"only in the guide: {sorted(documented - fields)}; "
                                  f"only in `jobs --json`: {sorted(fields - documented)}")


def test_every_command_is_in_the_docs():
    # The other way round from the tests above: a command no document names is one an admin never learns of
    # (`nvml assert` and `node sync` were named only in passing, with nothing on what they do).
    every = "\n".join([(ROOT / "README.md").read_text()] + [p.read_text() for p in (ROOT / "docs").glob("*.md")])
    named = set()
    for m in re.finditer(r"slurm-mig (?:--config \S+ )?([a-z][a-z-]+)(?: ([a-z][a-z|-]+))?", every):
        named.add((m.group(1),))
        for word in (m.group(2) or "").split("|"):
            named.add((m.group(1), word))
    missing = []
    for name, parser in _subparsers(build_parser()).items():
        subs = _subparsers(parser)
        missing += [f"slurm-mig {name} {s}" for s in (subs or {}) if (name, s) not in named]
        if not subs and (name,) not in named:
            missing.append(f"slurm-mig {name}")
    assert not missing, f"no document names {missing}"
