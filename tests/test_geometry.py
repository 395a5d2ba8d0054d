"""MIG geometry: profile tables, layout rules, maximal layouts and transitions."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_mig.cli import main
from slurm_mig.errors import GeometryError, InvalidLayout, TransitionBlocked
from slurm_mig.mig import GPU_MODELS, Layout, Slot, enumerate_maximal_layouts, get_model, parse_layout, plan_transition
from slurm_mig.mig.layout import iter_valid_layouts
from slurm_mig.mig.profiles import model_from_nvml_name
from slurm_mig.mig.transitions import apply_steps, carve_options

# FACTS.md §1: the 19 maximal layouts of the A100/H100 family, written out by hand.
FACTS_19 = """7g@0
4g@0,3g@4
4g@0,2g@4,1g@6
4g@0,1g@4,1g@5,1g@6
3g@0,3g@4
3g@0,2g@4,1g@6
3g@0,1g@4,1g@5,1g@6
2g@0,2g@2,3g@4
2g@0,2g@2,2g@4,1g@6
2g@0,2g@2,1g@4,1g@5,1g@6
2g@0,1g@2,1g@3,3g@4
2g@0,1g@2,1g@3,2g@4,1g@6
2g@0,1g@2,1g@3,1g@4,1g@5,1g@6
1g@0,1g@1,2g@2,3g@4
1g@0,1g@1,2g@2,2g@4,1g@6
1g@0,1g@1,2g@2,1g@4,1g@5,1g@6
1g@0,1g@1,1g@2,1g@3,3g@4
1g@0,1g@1,1g@2,1g@3,2g@4,1g@6
1g@0,1g@1,1g@2,1g@3,1g@4,1g@5,1g@6""".split()


def independent_valid(model, slots) -> bool:
    """A second, deliberately naive implementation of the MIG rules: slice arrays, no bit masks."""
    memory = [None] * model.memory_slices
    compute = 0
    per_profile: dict[str, int] = {}
    for s in slots:
        p = next(p for p in model.profiles if p.name == s.profile)
        if s.start not in p.starts or s.start + p.memory_slices > model.memory_slices:
            return False
        for k in range(s.start, s.start + p.memory_slices):
            if memory[k] is not None:
                return False
            memory[k] = s
        compute += p.compute_slices
        per_profile[p.name] = per_profile.get(p.name, 0) + 1
        if per_profile[p.name] > p.max_count:
            return False
    return compute <= model.compute_slices


def independent_maximal(model, slots) -> bool:
    for p in model.basic_profiles:
        for start in p.starts:
            if independent_valid(model, list(slots) + [Slot(start, p.name)]):
                return False
    return True


@pytest.mark.parametrize("name,expected", [("A100-80GB", 19), ("H100-80GB", 19), ("A100-40GB", 19),
                                           ("H200-141GB", 19), ("B200-180GB", 19), ("A30-24GB", 5),
                                           ("H100-94GB", 19), ("H100-96GB", 19), ("GH200-144GB", 19),
                                           ("GB200-186GB", 19)])
def test_maximal_layout_counts(name, expected):
    layouts = enumerate_maximal_layouts(get_model(name))
    assert len(layouts) == expected
    assert len({l.slots for l in layouts}) == expected
    for l in layouts:
        assert independent_valid(l.model, l.slots), str(l)
        assert independent_maximal(l.model, l.slots), str(l)


def test_h100_layouts_are_exactly_the_facts_list():
    model = get_model("H100-80GB")
    assert [str(l) for l in enumerate_maximal_layouts(model)] == FACTS_19
    assert {parse_layout(t, model).slots for t in FACTS_19} == {l.slots for l in enumerate_maximal_layouts(model)}


def test_every_maximal_layout_found_by_brute_force():
    # Brute force over all subsets of basic placements, checked only by the naive rules.
    model = get_model("A100-80GB")
    cands = [Slot(st, p.name) for p in model.basic_profiles for st in p.starts]
    found = set()
    for mask in range(1 << len(cands)):
        slots = [c for i, c in enumerate(cands) if mask >> i & 1]
        if len(slots) > 7:
            continue
        if slots and independent_valid(model, slots) and independent_maximal(model, slots):
            found.add(frozenset(slots))
    assert found == {l.slots for l in enumerate_maximal_layouts(model)}


def test_profile_lookup():
    h100 = get_model("H100")
    assert h100.profile("3g").name == "3g.40gb"
    assert h100.profile("3g.40gb").memory_slices == 4
    assert h100.profile("7g").memory_slices == 8
    assert h100.profile("1g.20gb").kind == "1g.dm"
    assert h100.profile("1g.dm").starts == (0, 2, 4, 6)
    assert h100.profile("1g+me").max_count == 1
    assert h100.profile("19").name == "1g.10gb"
    assert get_model("H200-141GB").profile("3g").name == "3g.71gb"
    assert get_model("A100-40GB").profile("1g").name == "1g.5gb"
    assert get_model("B200").profile("7g").name == "7g.180gb"
    with pytest.raises(GeometryError, match="no MIG profile '5g'"):
        h100.profile("5g")
    with pytest.raises(GeometryError):
        get_model("A30").profile("3g")


# Profile names as NVIDIA publishes them (NVIDIA/mig-parted deployments/systemd/config-default.yaml, its
# "all-<profile>" configs and the "all-balanced" device filters; the MIG user guide's supported-GPU list):
# the models whose tables were not read from a driver here.
NVIDIA_PROFILE_NAMES = {
    "H100-94GB": {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"},
    "H100-96GB": {"1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"},
    "GH200-144GB": {"1g.18gb", "1g.18gb+me", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"},
    "B200-180GB": {"1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"},
    "GB200-186GB": {"1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb"},
}


@pytest.mark.parametrize("name", sorted(NVIDIA_PROFILE_NAMES))
def test_tables_from_nvidias_documents_use_its_profile_names(name):
    assert {p.name for p in get_model(name).profiles} == NVIDIA_PROFILE_NAMES[name]


def test_nvml_name_mapping():
    assert model_from_nvml_name("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    assert model_from_nvml_name("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert model_from_nvml_name("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
    assert model_from_nvml_name("NVIDIA H200").name == "H200-141GB"
    assert model_from_nvml_name("NVIDIA A30").name == "A30-24GB"
    assert model_from_nvml_name("Tesla V100-SXM2-16GB") is None


@pytest.mark.parametrize("name,model", [
    ("NVIDIA H100 PCIe", "H100-80GB"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA B200", "B200-180GB"),
    # Parts that share a word with another model's: their own table, or none.
    ("NVIDIA GH200 480GB", "H100-96GB"),
    ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
    ("NVIDIA H20", "H100-96GB"),
    ("NVIDIA H100 NVL", "H100-94GB"),
    ("NVIDIA H800 NVL", "H100-94GB"),
    ("NVIDIA H100 94GB HBM2e", "H100-94GB"),
    ("NVIDIA H100 SXM5 94GB", "H100-94GB"),
    ("NVIDIA H100 96GB", "H100-96GB"),
    ("NVIDIA H100", "H100-80GB"),  # a shared marker without a size is its first model's
    ("NVIDIA H200 NVL", "H200-141GB"),
    ("NVIDIA GB200", "GB200-186GB"),
    # Parts whose MIG geometry is not in our tables: not mislabelled as one whose name they contain.
    ("NVIDIA GH200", None),  # 96 or 144 GB: the name must say
    ("NVIDIA H100 NVL 80GB", None),
    ("NVIDIA H20 141GB", None),
    # A memory type the model's part is not made with is another part, often of another size.
    ("NVIDIA H20 HBM3e", None),  # the 141 GB H20, not our 96 GB table (7c08af5 gave it that)
    ("NVIDIA H20 HBM3", "H100-96GB"),
    ("NVIDIA GH200 480GB HBM3e", None),  # the 144 GB GH200 is 'GH200 144G HBM3e'
    ("NVIDIA H100 HBM3e", None),
    ("NVIDIA H100 PCIe HBM2e", "H100-80GB"),
    ("NVIDIA A100 80GB HBM3", None),
    ("NVIDIA H200 HBM3", None),
    ("NVIDIA B200 HBM3e", "B200-180GB"),
    ("NVIDIA A100X", None),
    ("NVIDIA A30X", None),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", None),
    ("NVIDIA GB300", None),
])
def test_nvml_names_match_whole_words_not_substrings(name, model):
    found = model_from_nvml_name(name)
    assert (found.name if found else None) == model


def test_every_model_says_which_memory_it_is_made_with():
    from slurm_mig.mig.profiles import _MEMORY_TYPES, GPU_MODELS

    assert set(_MEMORY_TYPES) == set(GPU_MODELS)


@pytest.mark.parametrize("text,problem", [
    ("3g@0,4g@0", "overlaps"),
    ("4g@0,3g@4,1g@0", "overlaps"),
    ("3g@2", "cannot start"),
    ("2g@6", "cannot start"),
    ("1g@7", "cannot start"),
    ("3g@0,4g@4", "cannot start"),
    ("1g.20gb@0,1g.20gb@2,1g.20gb@4,1g.20gb@6,1g@0", "overlaps"),
    ("1g+me@0,1g+me@1", "exceeds its maximum"),
])
def test_invalid_layouts_are_refused(text, problem):
    with pytest.raises(InvalidLayout, match=problem):
        parse_layout(text, get_model("H100"))


def test_compute_slice_limit():
    m = get_model("H100")
    # 4 double-memory 1g use 8 memory slices but only 4 compute: legal.
    assert parse_layout("1g.20gb@0,1g.20gb@2,1g.20gb@4,1g.20gb@6", m).compute_used == 4
    # 2g x3 + 1g@6 uses 7 compute slices: legal; nothing more fits.
    l = parse_layout("2g@0,2g@2,2g@4,1g@6", m)
    assert l.compute_used == 7 and l.is_maximal()


@pytest.mark.parametrize("text", ["3g", "3g@", "@4", "3g@x", "3g@0;2g@4", "bogus@0"])
def test_parse_layout_errors_name_the_item(text):
    with pytest.raises(GeometryError):
        parse_layout(text, get_model("H100"))


def test_json_form():
    l = parse_layout("3g@0,2g@4,1g@6", get_model("H100"))
    assert l.to_json() == [{"profile": "3g.40gb", "start": 0, "size": 4},
                           {"profile": "2g.20gb", "start": 4, "size": 2},
                           {"profile": "1g.10gb", "start": 6, "size": 1}]


def test_layouts_cli_json(capsys):
    assert main(["layouts", "--gpu", "A100-80GB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data) == 19
    assert data[0] == [{"profile": "7g.80gb", "start": 0, "size": 8}]
    assert all(set(item) == {"profile", "start", "size"} for layout in data for item in layout)


def test_layouts_cli_unknown_model(capsys):
    assert main(["layouts", "--gpu", "X100"]) == 2
    assert "unknown GPU model 'X100'" in capsys.readouterr().err


# -- transitions ------------------------------------------------------------

def test_transition_keeps_common_instances_and_orders_destroys_first():
    m = get_model("H100")
    cur = parse_layout("3g@0,2g@4,1g@6", m)
    tgt = parse_layout("3g@0,1g@4,1g@5,1g@6", m)
    steps = plan_transition(cur, tgt)
    assert [str(s) for s in steps] == ["destroy 2g.20gb@4", "create 1g.10gb@4", "create 1g.10gb@5"]


def test_transition_blocked_names_busy_instance():
    m = get_model("H100")
    cur = parse_layout("3g@0,2g@4,1g@6", m)
    with pytest.raises(TransitionBlocked, match="2g.20gb@4") as exc:
        plan_transition(cur, parse_layout("3g@0,3g@4", m), busy=[Slot(4, "2g.20gb")])
    assert exc.value.blocking == (Slot(4, "2g.20gb"),)
    # A busy instance the target keeps does not block.
    assert plan_transition(cur, parse_layout("3g@0,2g@4,1g@6", m), busy=[Slot(4, "2g.20gb")]) == []


def test_transition_to_invalid_target_refused():
    m = get_model("H100")
    bad = Layout(m, frozenset({Slot(0, "4g.40gb"), Slot(0, "3g.40gb")}))
    with pytest.raises(InvalidLayout):
        plan_transition(Layout.empty(m), bad)


def test_carve_never_touches_locked():
    m = get_model("H100")
    cur = parse_layout("3g@0,2g@4,1g@6", m)
    opts = carve_options(cur, "4g", locked=[Slot(0, "3g.40gb")])
    assert opts == []
    opts = carve_options(cur, "4g", locked=[Slot(6, "1g.10gb")])
    assert [str(o.target) for o in opts] == ["4g@0,2g@4,1g@6"]


MODELS = [get_model("H100-80GB"), get_model("A30-24GB")]
ALL_VALID = {m.name: list(iter_valid_layouts(m)) for m in MODELS}


@st.composite
def transition_case(draw):
    m = draw(st.sampled_from(MODELS))
    cur = draw(st.sampled_from(ALL_VALID[m.name]))
    tgt = draw(st.sampled_from(ALL_VALID[m.name]))
    busy = draw(st.sets(st.sampled_from(sorted(cur.slots)))) if cur.slots else set()
    return cur, tgt, frozenset(busy)


@settings(max_examples=400, deadline=None)
@given(transition_case())
def test_transition_property(case):
    cur, tgt, busy = case
    try:
        steps = plan_transition(cur, tgt, busy)
    except TransitionBlocked as exc:
        assert exc.blocking and set(exc.blocking) <= busy
        assert set(exc.blocking) <= cur.slots - tgt.slots
        return
    assert not (cur.slots - tgt.slots) & busy
    destroyed = {s.slot for s in steps if s.action == "destroy"}
    assert not destroyed & busy
    # Minimal: exactly the symmetric difference.
    assert destroyed == cur.slots - tgt.slots
    assert {s.slot for s in steps if s.action == "create"} == tgt.slots - cur.slots
    # Every intermediate state is valid and the end is the target.
    assert apply_steps(cur, steps).slots == tgt.slots


@settings(max_examples=300, deadline=None)
@given(transition_case(), st.sampled_from(["1g", "2g", "4g", "1g.dm"]))
def test_carve_property(case, kind):
    cur, _tgt, busy = case
    try:
        profile = cur.model.profile(kind)
    except GeometryError:
        return
    for opt in carve_options(cur, profile.name, busy):
        assert not opt.destroyed & busy
        assert independent_valid(cur.model, opt.target.slots)
        assert opt.slot in opt.target.slots
        assert busy <= opt.target.slots
        assert apply_steps(cur, plan_transition(cur, opt.target, busy)).slots == opt.target.slots
