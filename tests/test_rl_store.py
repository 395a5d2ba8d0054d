"""`slurm-mig policy list | install | rollback` and the policy store behind them (no torch needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slurm_mig.cli import main
from slurm_mig.errors import ConfigError
from slurm_mig.policies import get_policy
from slurm_mig.policies.rl import SHIPPED_MODEL, PolicyModelError, resolve_model_path
from slurm_mig.policy_registry import PolicyStore


@pytest.fixture(autouse=True)
def _store(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_MIG_RL_MODEL", raising=False)
    monkeypatch.setenv("SLURM_MIG_POLICY_STORE", str(tmp_path / "store"))
    monkeypatch.setattr("slurm_mig.policies.rl._config_model_path", lambda: "")


def model_dir(tmp_path: Path, name: str, **card_changes) -> Path:
    d = tmp_path / name
    d.mkdir()
    shutil.copy(SHIPPED_MODEL, d / "model.onnx")
    shutil.copy(SHIPPED_MODEL.parent / "guard.onnx", d / "guard.onnx")  # the card names it
    card = json.loads((SHIPPED_MODEL.parent / "model_card.json").read_text())
    card.update(card_changes)
    (d / "model_card.json").write_text(json.dumps(card))
    return d


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_list_install_rollback(tmp_path, capsys):
    assert resolve_model_path() == SHIPPED_MODEL  # no store yet: `list` says so (test_list_of_a_store_that_is_not_there)

    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "a", version="v1", created=1.0)), "--json")
    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "b", version="v2", created=2.0, placement="network")), "--json")
    out = run_json(capsys, "policy", "list", "--json")
    assert out["active"] == "v2"
    assert [(v["version"], v["active"]) for v in out["versions"]] == [("default", False), ("v1", False), ("v2", True)]
    assert resolve_model_path() == tmp_path / "store" / "v2" / "model.onnx"
    assert get_policy("rl").load().version == "v2"
    # rl-candidate: the newest stored version that is not active
    assert resolve_model_path(candidate=True) == tmp_path / "store" / "v1" / "model.onnx"

    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "v1"}
    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "default"}
    assert resolve_model_path() == SHIPPED_MODEL
    run_json(capsys, "policy", "install", "v2", "--json")
    assert PolicyStore().active() == "v2"

    assert main(["policy", "list"]) == 0
    text = capsys.readouterr().out
    assert "* v2" in text and "default" in text
    # who places single-instance jobs: the shipped card says frag-aware; v2's card, the network
    assert [ln for ln in text.splitlines() if " default " in ln][0].count("places: frag-aware") == 1
    assert "places: network" in [ln for ln in text.splitlines() if "* v2" in ln][0]


def test_install_refuses_a_model_for_other_features(tmp_path, capsys):
    bad = model_dir(tmp_path, "bad", version="old", feature_schema="rl-candidates/0")
    assert main(["policy", "install", str(bad)]) != 0
    assert "feature schema" in capsys.readouterr().err
    assert PolicyStore().active() == "default"


def test_unknown_version_and_duplicates(tmp_path):
    st = PolicyStore()
    with pytest.raises(ConfigError, match="no policy version"):
        st.install("nope")
    st.add(model_dir(tmp_path, "a", version="v1"))
    with pytest.raises(ConfigError, match="already exists"):
        st.add(model_dir(tmp_path, "b", version="v1"))
    with pytest.raises(ConfigError, match="bad policy version"):
        st.add(model_dir(tmp_path, "c"), version="../evil")
    with pytest.raises(ConfigError, match="bad policy version"):
        st.add(model_dir(tmp_path, "d"), version="v2\n")  # a folder name with a newline in it


def test_retrain_without_a_db_is_a_clear_error(tmp_path, capsys):
    assert main(["policy", "retrain", "--db", str(tmp_path / "missing.db")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="the configs are judged as root only")
def test_retrain_as_root_refuses_a_config_others_may_change(tmp_path, capsys, monkeypatch):
    """Root's `policy retrain` trained on the db_path of a config anyone could change (and fine-tuned the model
    its [policy].model_path names), while the controller and the hooks refuse such a config (check_trusted)."""
    from training.retrain import main as retrain_main

    db = tmp_path / "missing.db"
    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[controller]\ndb_path = "{db}"\n')
    cfg.chmod(0o666)
    monkeypatch.delenv("SLURM_MIG_CONFIG", raising=False)
    assert main(["--config", str(cfg), "policy", "retrain"]) == 2
    err = capsys.readouterr().err
    assert f"config {cfg}" in err and "writable by anyone" in err and "policy retrain" in err, err
    # With --db too: the config found ($SLURM_MIG_CONFIG) names the model retraining fine-tunes
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(cfg))
    assert main(["policy", "retrain", "--db", str(db)]) == 2
    assert "writable by anyone" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="writable by anyone"):
        retrain_main(["--db", str(db)])
    cfg.chmod(0o644)  # root's own config: read, and its db_path used
    assert main(["--config", str(cfg), "policy", "retrain"]) == 2
    assert f"state DB {db} does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value,said", [("--minutes", "nan", "--minutes must be"), ("--minutes", "0", "--minutes"),
                                             ("--minutes", "-5", "--minutes"), ("--iterations", "0", "--iterations")])
def test_retrain_refuses_a_budget_that_is_no_budget_before_reading_the_db(tmp_path, capsys, flag, value, said):
    # train.py took 0 minutes for no limit, a negative budget as spent and NaN as never reached
    db = tmp_path / "state.db"
    db.write_bytes(b"")  # read only after the arguments are checked: an empty file would fail there otherwise
    assert main(["policy", "retrain", "--db", str(db), flag, value]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


class _RunsCode:
    """Unpickling this touches a file: what a hostile model.pt would do as root during retraining."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return (Path.touch, (self.mark,))


def _torch_zip(path: Path, obj, protocol: int) -> Path:
    """A file laid out as torch.save writes one (a zip with <name>/data.pkl), built without torch."""
    import pickle
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model/data.pkl", pickle.dumps(obj, protocol=protocol))
        z.writestr("model/version", "3\n")
    return path


@pytest.mark.parametrize("protocol", [2, 4])  # GLOBAL (torch.save's protocol) and STACK_GLOBAL
def test_install_refuses_a_model_pt_that_is_more_than_weights(tmp_path, capsys, protocol):
    mark = tmp_path / "ran"
    d = model_dir(tmp_path, "evil", version="v1")
    _torch_zip(d / "model.pt", {"state_dict": _RunsCode(mark)}, protocol)
    assert main(["policy", "install", str(d)]) == 2
    err = capsys.readouterr().err
    assert "refusing it" in err and "Traceback" not in err
    assert not mark.exists() and not (tmp_path / "store" / "v1").exists()
    assert PolicyStore().active() == "default"


def test_install_refuses_a_model_pt_that_is_no_checkpoint(tmp_path, capsys):
    d = model_dir(tmp_path, "junk", version="v1")
    (d / "model.pt").write_bytes(b"\x80\x04K\x01.")  # a bare pickle, not torch's zip
    assert main(["policy", "install", str(d)]) == 2
    assert "not a torch checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "store" / "v1").exists()


def test_install_keeps_the_shipped_weights(tmp_path):
    d = model_dir(tmp_path, "ok", version="v1")
    shutil.copy(SHIPPED_MODEL.with_name("default.pt"), d / "model.pt")
    PolicyStore().add(d)
    assert (tmp_path / "store" / "v1" / "model.pt").read_bytes() == (d / "model.pt").read_bytes()


def test_install_of_a_named_onnx_takes_its_own_weights_not_another_models(tmp_path, capsys):
    """`policy install DIR/x.onnx` copied DIR/model.pt, whatever model it belonged to: from a folder holding
    model.onnx and its model.pt beside x.onnx and x.card.json, version x was stored with model.onnx's weights,
    and `policy retrain` fine-tuned x from them. Found by installing such an x.onnx and comparing the stored
    model.pt with the folder's. The weights are now those named as the model: x.pt for x.onnx (default.pt for
    the shipped default.onnx, as training/guard.py pairs them); none when there are none."""
    d = model_dir(tmp_path, "two")  # model.onnx, its card, guard.onnx
    _torch_zip(d / "model.pt", {"state_dict": {"w": 1}}, 2)  # model.onnx's weights
    shutil.copy(d / "model.onnx", d / "x.onnx")
    card = json.loads((d / "model_card.json").read_text())
    (d / "x.card.json").write_text(json.dumps({**card, "version": "x1"}))
    run_json(capsys, "policy", "install", str(d / "x.onnx"), "--json")
    assert not (tmp_path / "store" / "x1" / "model.pt").exists()
    _torch_zip(d / "x.pt", {"state_dict": {"w": 2}}, 2)
    (d / "x.card.json").write_text(json.dumps({**card, "version": "x2"}))
    run_json(capsys, "policy", "install", str(d / "x.onnx"), "--json")
    assert (tmp_path / "store" / "x2" / "model.pt").read_bytes() == (d / "x.pt").read_bytes()
    # model.onnx keeps its model.pt; the shipped default.onnx brings default.pt
    (d / "model_card.json").write_text(json.dumps({**card, "version": "m1"}))
    run_json(capsys, "policy", "install", str(d), "--json")
    assert (tmp_path / "store" / "m1" / "model.pt").read_bytes() == (d / "model.pt").read_bytes()
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED_MODEL.parent, shipped)
    (shipped / "model_card.json").write_text(json.dumps({**card, "version": "d1"}))
    run_json(capsys, "policy", "install", str(shipped / "default.onnx"), "--json")
    assert (tmp_path / "store" / "d1" / "model.pt").read_bytes() == SHIPPED_MODEL.with_name("default.pt").read_bytes()


def test_install_by_name_takes_the_stored_version_not_a_folder_here(tmp_path, monkeypatch, capsys):
    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "src", version="v1", created=1.0)), "--json")
    run_json(capsys, "policy", "install", "default", "--json")
    work = tmp_path / "work"
    work.mkdir()
    model_dir(work, "v1", version="experiment-7", created=2.0)  # an unrelated folder that shares the name
    monkeypatch.chdir(work)
    assert run_json(capsys, "policy", "install", "v1", "--json")["path"] == str(tmp_path / "store" / "v1" / "model.onnx")
    assert [v.version for v in PolicyStore().versions()] == ["default", "v1"]
    # a bare name that is no stored version: refused, with how to add the folder
    model_dir(work, "new", version="v2")
    assert main(["policy", "install", "new"]) == 2
    assert "./new" in capsys.readouterr().err
    assert run_json(capsys, "policy", "install", "./new", "--json")["version"] == "v2"
    assert main(["policy", "install", "./missing"]) == 2
    assert "no such model folder" in capsys.readouterr().err


def test_a_hand_written_created_date_is_listed_not_a_crash(tmp_path, capsys):
    PolicyStore().add(model_dir(tmp_path, "a", version="v1", created="2026-01-01"))
    PolicyStore().add(model_dir(tmp_path, "b", version="v2", created=2.0))
    assert main(["policy", "list"]) == 0
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if " v1 " in ln][0].split()[1] == "2026-01-01"
    assert [v["created"] for v in run_json(capsys, "policy", "list", "--json")["versions"][1:]] == ["2026-01-01", 2.0]


@pytest.mark.parametrize("history", ['[{"v": "x"}]', '["v1"]', '{"version": "v1"}', "[{"])
def test_a_malformed_history_is_refused_and_kept(tmp_path, capsys, history):
    PolicyStore().add(model_dir(tmp_path, "a", version="v1"))
    hist = tmp_path / "store" / "history.json"
    hist.write_text(history)
    for argv in (["policy", "rollback"], ["policy", "install", "v1"], ["policy", "install", "default"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "history.json" in err and "fix or remove it" in err and "Traceback" not in err
    assert hist.read_text() == history and PolicyStore().active() == "default"
    # A path is refused before it is added: added first, it stayed in the store inactive, and installing the same
    # path again, once the history was fixed, said "already exists"
    assert main(["policy", "install", str(model_dir(tmp_path, "b", version="v2"))]) == 2
    assert "fix or remove it" in capsys.readouterr().err
    assert [v.version for v in PolicyStore().versions()] == ["default", "v1"]


def test_a_store_that_is_no_directory_is_a_clear_error(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    src = model_dir(tmp_path, "a", version="v1")
    for store in (afile, afile / "sub"):
        for argv in (["install", str(src)], ["install", "default"], ["rollback"]):
            assert main(["policy", *argv, "--store", str(store)]) == 2
            err = capsys.readouterr().err
            assert "policy store" in err and "Traceback" not in err, err
    assert afile.read_text() == ""


def test_install_says_when_a_pin_keeps_the_controller_on_another_model(tmp_path, monkeypatch, capsys):
    assert main(["policy", "install", str(model_dir(tmp_path, "a", version="v1"))]) == 0
    out = capsys.readouterr()
    assert "reloads it within seconds" in out.out and "warning" not in out.err  # nothing pins the model

    cfg = tmp_path / "slurm-mig.toml"
    cfg.write_text(f'[policy]\nname = "rl"\nfallback = "frag-aware"\nmodel_path = "{SHIPPED_MODEL}"\n')
    assert main(["--config", str(cfg), "policy", "install", "default"]) == 0
    out = capsys.readouterr()
    assert "reloads it within seconds" not in out.out
    assert f"warning: [policy].model_path = {SHIPPED_MODEL} pins" in out.err
    assert PolicyStore().active() == "default"  # installing still happened

    # A config it cannot read: said, not taken as "nothing pins the model" without a word.
    bad = tmp_path / "bad.toml"
    bad.write_text('[policy]\nname = 3\n')
    assert main(["--config", str(bad), "policy", "install", "v1"]) == 0
    err = capsys.readouterr().err
    assert f"warning: cannot tell whether {bad} pins the rl policy's model" in err and "[policy].name" in err
    assert PolicyStore().active() == "v1"

    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(SHIPPED_MODEL))
    assert run_json(capsys, "policy", "install", "v1", "--json")["pinned_by"] == f"$SLURM_MIG_RL_MODEL={SHIPPED_MODEL}"
    assert main(["policy", "install", "v1"]) == 0
    assert "warning: $SLURM_MIG_RL_MODEL=" in capsys.readouterr().err


def test_retrain_names_a_pinned_model_by_its_path_not_the_stores_active_version(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from training.retrain import current_model

    PolicyStore().install(PolicyStore().add(model_dir(tmp_path, "a", version="v1")).version)
    assert current_model()[:2] == ("v1", tmp_path / "store" / "v1" / "model.onnx")
    pinned = model_dir(tmp_path, "p", version="v7") / "model.onnx"
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(pinned))
    # It fine-tunes the pinned file, and says so: until 2026-11-27 it was called v1 in the report and the card
    assert current_model()[:2] == (f"pinned:{pinned}", pinned)


def test_retrain_fine_tunes_a_pinned_model_from_its_own_weights_only(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    from training.retrain import current_model

    folder = model_dir(tmp_path, "p", version="v7")
    shutil.copy(SHIPPED_MODEL.with_suffix(".pt"), folder / "model.pt")  # model.onnx's weights, not x's
    x = folder / "x.onnx"
    shutil.copy(folder / "model.onnx", x)
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(x))
    assert current_model()[2] is None  # until 2026-11-27: folder/model.pt, another model's weights
    shutil.copy(folder / "model.pt", folder / "x.pt")
    assert current_model()[2] == folder / "x.pt"
    monkeypatch.delenv("SLURM_MIG_RL_MODEL")
    assert current_model()[1:] == (SHIPPED_MODEL, SHIPPED_MODEL.with_suffix(".pt"))


def test_training_retrain_install_says_when_a_pin_keeps_the_old_model(monkeypatch, capsys):
    """`python -m training.retrain --install` installed without a word about a pin (noticed in review);
    `slurm-mig policy retrain --install` already warned. The retraining itself is stood in for here:
    what is tested is what the command says after an install."""
    pytest.importorskip("torch")
    import training.retrain as rt

    monkeypatch.setattr(rt, "retrain", lambda *a, **k: {"decision": "installed", "new_version": "v9"})
    monkeypatch.setattr(rt, "format_report", lambda r: f"decision: {r['decision']}")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(SHIPPED_MODEL))
    assert rt.main(["--db", "state.db", "--install"]) == 0
    assert f"warning: $SLURM_MIG_RL_MODEL={SHIPPED_MODEL} pins" in capsys.readouterr().err
    monkeypatch.delenv("SLURM_MIG_RL_MODEL")
    monkeypatch.setattr("slurm_mig.policies.rl._config_model_path", lambda: "")
    assert rt.main(["--db", "state.db", "--install"]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("change", ["list", "features", "guard_features"])
def test_install_refuses_a_card_of_the_wrong_shape_with_a_clear_error(tmp_path, capsys, change):
    src = model_dir(tmp_path, "a", version="v1")
    card = json.loads((src / "model_card.json").read_text())
    card = {"list": [card], "features": {**card, "features": 46},
            "guard_features": {**card, "guard": {**card["guard"], "features": 7}}}[change]
    (src / "model_card.json").write_text(json.dumps(card))
    assert main(["policy", "install", str(src)]) != 0
    err = capsys.readouterr().err
    assert ("JSON object" in err or "feature list" in err) and "Traceback" not in err, err
    assert PolicyStore().active() == "default" and not (tmp_path / "store" / "v1").exists()


def test_the_shadow_candidate_is_found_beside_a_hand_written_date_or_a_broken_card(tmp_path):
    """rl-candidate compared the stored versions' ``created`` as written: a hand-written date beside a
    number raised TypeError, and a card that is not an object AttributeError, so the shadow policy failed
    every tick while the store held a good candidate. The order is now list's (a number, else 0)."""
    st = PolicyStore()
    st.add(model_dir(tmp_path, "a", version="v1", created="2026-01-01"))
    st.add(model_dir(tmp_path, "b", version="v2", created=2.0))
    st.add(model_dir(tmp_path, "c", version="v3", created=3.0))
    st.install("v3")
    assert resolve_model_path(candidate=True) == tmp_path / "store" / "v2" / "model.onnx"
    assert get_policy("rl-candidate").load().version == "v2"
    (tmp_path / "store" / "v1" / "model_card.json").write_text("[1]")
    assert resolve_model_path(candidate=True) == tmp_path / "store" / "v2" / "model.onnx"


@pytest.mark.parametrize("card", [
    {"feature_schema": None}, {"feature_schema": 1}, {"metrics": [1]}, {"metrics": {"heldout": {"x": 3}}},
    {"metrics": {"heldout": {"x": {"rl_over_best_wait": "1.0"}}}}, {"metrics": {"candidate_mean_wait_s": "5"}},
    {"metrics": {"candidate_mean_wait_s": 5, "current_mean_wait_s": None}},
    {"validation_wait_ratio_vs_frag_aware": "0.9"}, {"created": 1e300}, {"created": float("inf")},
])
def test_list_shows_a_stored_card_of_wrong_types_instead_of_crashing(tmp_path, capsys, card):
    """`policy list` reads every folder of the store, and a card there is hand-editable (or from another
    slurm-mig): one field of an unexpected type ended the listing in a traceback."""
    PolicyStore().add(model_dir(tmp_path, "a", version="v1"))
    (tmp_path / "store" / "v1" / "model_card.json").write_text(json.dumps(card))
    assert main(["policy", "list"]) == 0
    assert [ln for ln in capsys.readouterr().out.splitlines() if " v1 " in ln]


class _Stopped(BaseException):
    """The command killed between two writes."""


@pytest.mark.parametrize("stop_at", [1, 2])
def test_a_rollback_stopped_halfway_never_leads_back_to_the_version_rolled_back_from(tmp_path, monkeypatch, stop_at):
    """rollback wrote ``active`` and then history.json: killed in between, the previous version ran with the
    current one still last in the history, and the next rollback re-activated that current one."""
    import os

    st = PolicyStore()
    for v in ("v1", "v2"):
        st.add(model_dir(tmp_path, v, version=v))
        st.install(v)
    real, calls = os.replace, []

    def replace(a, b):
        calls.append(b)
        if len(calls) == stop_at:
            raise _Stopped
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(_Stopped):
        st.rollback()
    monkeypatch.setattr(os, "replace", real)
    seen = [st.active()]
    while seen[-1] != "default" and len(seen) < 5:
        seen.append(st.rollback())
    assert seen in (["v2", "v1", "default"], ["v1", "default"]), seen


def test_the_folder_of_a_stopped_install_is_no_version(tmp_path, capsys):
    """add() copies into ".<version>.<random>" and renames it into place; killed before the rename, that
    folder stayed, and list showed it as a version, install took it by that name, and rl-candidate (the
    shadow) could choose it, its model.onnx half copied."""
    st = PolicyStore()
    st.add(model_dir(tmp_path, "a", version="v1", created=1.0))
    st.install("v1")
    left = model_dir(tmp_path / "store", ".v2.k3j4h5", version="v2", created=2.0)
    (left / "model.onnx").write_bytes(SHIPPED_MODEL.read_bytes()[:1000])
    assert [v["version"] for v in run_json(capsys, "policy", "list", "--json")["versions"]] == ["default", "v1"]
    assert main(["policy", "install", left.name]) != 0
    assert "no policy version" in capsys.readouterr().err
    with pytest.raises(PolicyModelError, match="no candidate"):  # v1 is active: there is none
        resolve_model_path(candidate=True)


def test_two_admins_installing_at_once_both_land_in_order(tmp_path, monkeypatch):
    """install wrote ``.active.tmp`` and renamed it to ``active``, reading history.json before and writing it
    after, with nothing to keep a second install (another admin's, or a `retrain --install` finishing) out
    in between: the second one's write went into the first's temporary file, the first's rename then put
    the second's version in place and printed its own as active, the second's rename found no file
    (FileNotFoundError, a traceback) and one activation was lost from the history. Changes to the store
    now wait for one another (a lock file in the store)."""
    import os
    import threading

    st = PolicyStore()
    for v in ("v1", "v2"):
        st.add(model_dir(tmp_path, v, version=v))
    real, main_thread = os.replace, threading.current_thread()
    other_started, other_done, errors = threading.Event(), threading.Event(), []

    def other_admin():
        try:
            PolicyStore().install("v2")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            other_done.set()

    def replace(a, b):
        if threading.current_thread() is main_thread and Path(b).name == "active" and not other_started.is_set():
            other_started.set()  # the first admin is about to rename: the second one starts now
            threading.Thread(target=other_admin, daemon=True).start()
            other_done.wait(1.0)  # it waits for the first (with the fix) or runs to its end (without)
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    PolicyStore().install("v1")
    assert other_done.wait(30)
    monkeypatch.setattr(os, "replace", real)
    assert errors == []
    assert [e["version"] for e in PolicyStore().history()] == ["v1", "v2"]
    assert PolicyStore().active() == "v2"


def test_the_store_is_written_with_its_modes_whatever_the_umask_and_the_source_files(tmp_path, monkeypatch):
    """The store's folder and the missing ones above it were made by mkdir(parents=True), active and history.json
    by write_text, all with the umask's mode: world-writable under umask 0, so that anyone could put an ``active``
    of their own there, naming a model the root controller would run (and /var/lib/slurm-mig, made first by an
    install before the controller's first start, stayed so: the database's folder is left as it is when it
    exists); and a model's files kept the mode of the files installed (copy2), 0666 from a folder so written.
    Folders are now 0755 (made with it, then chmod-ed), every file 0644."""
    import os
    import stat

    src = model_dir(tmp_path, "src", version="v1")
    for f in src.iterdir():
        f.chmod(0o666)
    root = tmp_path / "var" / "lib" / "slurm-mig" / "policies"
    monkeypatch.setenv("SLURM_MIG_POLICY_STORE", str(root))
    old = os.umask(0)
    try:
        st = PolicyStore()
        st.install(st.add(src).version)
        st.rollback()
    finally:
        os.umask(old)
    made = [tmp_path / "var", tmp_path / "var" / "lib", tmp_path / "var" / "lib" / "slurm-mig", root, root / "v1"]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"active", "history.json", "model.onnx", "guard.onnx", "model_card.json"}
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {str(p): "0o755" for p in made}
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {str(p): "0o644" for p in files}


def test_every_write_of_the_store_is_on_disk_before_and_after_its_rename(tmp_path, monkeypatch):
    """active, history.json and a version's files were renamed into place without an fsync of the file before
    nor of its folder after: after a power cut 'active' could be empty (the controller then ran the shipped
    model) and a version's files empty. Each is now fsynced before its rename, and its folder after it."""
    import os

    real_fsync, real_replace, events = os.fsync, os.replace, []

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", str(a), str(b)))
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    st = PolicyStore()
    st.install(st.add(model_dir(tmp_path, "src", version="v1")).version)
    st.rollback()
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(os, "replace", real_replace)

    root = str(tmp_path / "store")
    assert ("fsync", str(tmp_path)) in events  # the store folder made here
    renames = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert sorted({Path(events[i][2]).name for i in renames}) == ["active", "history.json", "v1"]
    for n, i in enumerate(renames):
        _, src, dst = events[i]
        before = {e[1] for e in events[(renames[n - 1] if n else 0):i] if e[0] == "fsync"}
        after = {e[1] for e in events[i + 1:(renames[n + 1] if n + 1 < len(renames) else len(events))]
                 if e[0] == "fsync"}
        need = {src} | ({str(p) for p in Path(dst).iterdir()} if Path(dst).is_dir() else set())
        need = {p.replace(dst, src) for p in need}  # the files as they were named before the folder's rename
        assert need <= before, (dst, need - before)
        assert root in after, dst


def test_an_active_that_names_no_version_is_said_by_list_and_stops_rollback(tmp_path, capsys):
    """With 'active' empty (a power cut) list said 'active: default' and marked the shipped model, which the
    controller did not run, and rollback went back from 'default'. list now warns with the reason and marks
    none; rollback refuses, naming the history's last version; install repairs it."""
    st = PolicyStore()
    for v in ("v1", "v2"):
        st.add(model_dir(tmp_path, v, version=v))
        st.install(v)
    (tmp_path / "store" / "active").write_text("")
    out = run_json(capsys, "policy", "list", "--json")
    assert out["active"] is None and "is empty" in out["active_problem"]
    assert not any(v["active"] for v in out["versions"])
    assert main(["policy", "list"]) == 0
    cap = capsys.readouterr()
    assert "(active: none)" in cap.out and "*" not in cap.out and "is empty" in cap.err
    assert main(["policy", "rollback"]) != 0
    err = capsys.readouterr().err
    assert "cannot roll back" in err and "history's last activation: v2" in err
    run_json(capsys, "policy", "install", "v1", "--json")
    assert st.active() == "v1" and st.active_problem() == ""


def test_a_rollback_to_a_deleted_version_says_what_to_do_instead(tmp_path, capsys):
    """rollback to a version whose folder was removed failed every time with "no policy version 'v2'" and
    nothing about how to go on. It still refuses (reaching further back would run a model older than the
    admin asked for), and now names the earlier versions of the history that still exist and the command."""
    st = PolicyStore()
    for v in ("v1", "v2", "v3"):
        st.add(model_dir(tmp_path, v, version=v))
        st.install(v)
    shutil.rmtree(tmp_path / "store" / "v2")
    assert main(["policy", "rollback"]) != 0
    err = capsys.readouterr().err
    assert "cannot roll back to v2" in err and str(tmp_path / "store" / "v2") in err
    assert "slurm-mig policy install v1" in err and "default" in err
    assert st.active() == "v3" and [e["version"] for e in st.history()] == ["v1", "v2", "v3"]
    st.install("v1")
    assert st.rollback() == "v3"


@pytest.mark.parametrize("damage", ["schema", "onnx"])
def test_a_rollback_to_a_version_that_no_longer_loads_is_refused(tmp_path, capsys, damage):
    """install checks that a version loads (its card's feature schema, its ONNX file); rollback did not, so a
    rollback to a version whose card or model.onnx had changed since made it active, and the controller's rl
    policy failed on every tick (its [policy].fallback deciding) though rollback said 'rolled back'. It now
    makes the same check, refuses and changes nothing."""
    st = PolicyStore()
    for v in ("v1", "v2"):
        st.add(model_dir(tmp_path, v, version=v))
        st.install(v)
    if damage == "schema":
        card = tmp_path / "store" / "v1" / "model_card.json"
        card.write_text(json.dumps({**json.loads(card.read_text()), "feature_schema": "rl-candidates/0"}))
    else:
        (tmp_path / "store" / "v1" / "model.onnx").write_bytes(b"not an onnx model")
    assert main(["policy", "rollback"]) != 0
    err = capsys.readouterr().err
    assert "cannot roll back to v1" in err and "v2 stays active" in err, err
    assert "slurm-mig policy install default" in err and "Traceback" not in err, err
    assert st.active() == "v2" and [e["version"] for e in st.history()] == ["v1", "v2"]


def test_a_rollback_with_nothing_left_to_roll_back_says_so_and_fails(tmp_path, capsys):
    """With the shipped model active and no earlier activation in the history, rollback 'went back' to default
    again, printed 'rolled back; active policy version: default' and exited 0 (on a store that did not exist yet
    it made one): a script or an admin took that for a change. It now fails, saying nothing is left to roll back,
    and changes nothing."""
    assert main(["policy", "rollback"]) != 0
    cap = capsys.readouterr()
    assert "rolled back" not in cap.out and "nothing to roll back" in cap.err, cap
    assert not (tmp_path / "store").exists()
    st = PolicyStore()
    st.add(model_dir(tmp_path, "v1", version="v1"))
    st.install("v1")
    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "default"}
    before = {p.name: p.read_bytes() for p in (tmp_path / "store").iterdir() if p.is_file()}
    assert main(["policy", "rollback", "--json"]) != 0
    cap = capsys.readouterr()
    assert cap.out == "" and "nothing to roll back" in cap.err and "default is active" in cap.err, cap
    assert {p.name: p.read_bytes() for p in (tmp_path / "store").iterdir() if p.is_file()} == before
    st.install("v1")
    st.activate("default")  # (policy install default) an activation of default is one to roll back from
    assert st.rollback() == "v1"


def _damage_shipped_model(tmp_path, monkeypatch) -> None:
    """The shipped model as a broken package leaves it: a default.onnx that is not a model, beside its card."""
    bad = tmp_path / "shipped" / "default.onnx"
    bad.parent.mkdir()
    bad.write_bytes(b"not a model")
    shutil.copy(SHIPPED_MODEL.parent / "model_card.json", bad.parent / "model_card.json")
    monkeypatch.setattr("slurm_mig.policy_registry.SHIPPED_MODEL", bad)


def test_install_default_checks_the_shipped_model_loads(tmp_path, monkeypatch, capsys):
    """`policy install VERSION` refuses a model that does not load; `policy install default` activated the shipped
    model unchecked, so a damaged or missing policy/default.onnx (a broken package) made the controller's rl
    policy fail every tick, its fallback deciding. It is load-checked too now, and the active version kept."""
    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "src", version="v1")), "--json")
    _damage_shipped_model(tmp_path, monkeypatch)
    assert main(["policy", "install", "default"]) == 2
    assert "default cannot be used" in capsys.readouterr().err
    assert PolicyStore().active() == "v1"
    monkeypatch.setattr("slurm_mig.policy_registry.SHIPPED_MODEL", SHIPPED_MODEL)
    assert run_json(capsys, "policy", "install", "default", "--json") == {"version": "default", "active": True,
                                                                          "pinned_by": None}


def test_a_model_whose_store_copy_would_not_load_is_not_added(tmp_path, capsys):
    """add() checked the model where it was given and then copied only model.onnx, the guard, the card and
    model.pt. A model that keeps its weights in another file (ONNX external data, onnx.save(...,
    save_as_external_data=True)) loaded there, was added without the file, and install's second check then
    refused it: the broken version stayed in the store, listed like any other, the newest for rl-candidate
    (the shadow failed every tick), and installing the folder again said "already exists". Found by
    installing such a model into a temporary store. The copy is checked now, before it is renamed into place."""
    onnx = pytest.importorskip("onnx")
    from onnx.external_data_helper import convert_model_to_external_data

    d = model_dir(tmp_path, "ext", version="v1", created=1.0)
    m = onnx.load(str(d / "model.onnx"))
    convert_model_to_external_data(m, all_tensors_to_one_file=True, location="weights.bin", size_threshold=1024)
    onnx.save_model(m, str(d / "model.onnx"))
    assert (d / "weights.bin").is_file()
    assert main(["policy", "install", str(d)]) != 0
    err = capsys.readouterr().err
    assert "nothing was added" in err and "weights.bin" in err
    store = tmp_path / "store"
    assert [p.name for p in store.iterdir() if not p.name.startswith(".")] == []  # no version, no active
    assert [p for p in store.iterdir() if p.name.startswith(".v1.")] == []  # nor its temporary folder
    assert [v["version"] for v in run_json(capsys, "policy", "list", "--json")["versions"]] == ["default"]
    with pytest.raises(PolicyModelError, match="no candidate"):
        resolve_model_path(candidate=True)


@pytest.mark.parametrize("name", ["active", "history.json"])
def test_a_version_may_not_take_the_name_of_a_store_file(tmp_path, capsys, name):
    """A card whose version was "active" or "history.json" (both fit VERSION_RE) was added as the folder of
    that name: install then failed with a traceback (IsADirectoryError renaming 'active' over the folder), the
    controller's rl policy could not read 'active' (fallback every tick), and every later install or rollback
    failed until the folder was removed by hand; "history.json" stopped install and rollback alike. Found by
    installing cards so named into a temporary store. Refused now as a bad version name, nothing written."""
    st = PolicyStore()
    st.add(model_dir(tmp_path, "a", version="v1", created=1.0))
    st.install("v1")
    before = sorted(p.name for p in (tmp_path / "store").iterdir())
    assert main(["policy", "install", str(model_dir(tmp_path, "b", version=name, created=2.0))]) != 0
    assert f"bad policy version name {name!r}" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == before
    assert (tmp_path / "store" / "active").is_file() and (tmp_path / "store" / "history.json").is_file()
    assert run_json(capsys, "policy", "list", "--json")["active"] == "v1"
    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "default"}
    with pytest.raises(ConfigError, match="bad policy version name"):
        st.add(model_dir(tmp_path, "c", version="v3"), name)  # named by the caller (retrain, tests) too


def test_a_store_anyone_may_write_is_refused_not_written(tmp_path, capsys):
    """A store folder that already existed was used whatever its mode: one left 0777 (made under umask 0 before
    2026-11-27, or by hand) took root's installs and rollbacks without a word, while anyone could put an
    'active' or a version there for root's controller to run, or a '.lock' symlink for root to create a file
    through. Found by chmod 0777 on a temporary store and installing. Refused now, saying how to fix it;
    nothing is written."""
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    assert main(["policy", "install", str(model_dir(tmp_path, "a", version="v1"))]) != 0
    err = capsys.readouterr().err
    assert "writable by anyone" in err and f"chmod o-w {root}" in err
    assert list(root.iterdir()) == []
    assert main(["policy", "rollback"]) != 0 and "writable by anyone" in capsys.readouterr().err
    root.chmod(0o755)
    assert run_json(capsys, "policy", "install", str(tmp_path / "a"), "--json")["version"] == "v1"


def test_a_rollback_to_a_shipped_model_that_does_not_load_is_refused(tmp_path, monkeypatch, capsys):
    """rollback checked the version it went back to as install does, except the shipped ``default``: with a
    damaged or missing policy/default.onnx (a broken package), `install default` refused, but a rollback to
    it made it active, and the controller's rl policy failed every tick, its fallback deciding. Found by
    rolling back a temporary store with SHIPPED_MODEL pointing at a file that is not a model. Refused now,
    the current version kept."""
    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "src", version="v1")), "--json")
    _damage_shipped_model(tmp_path, monkeypatch)
    history = (tmp_path / "store" / "history.json").read_text()
    assert main(["policy", "rollback"]) == 2
    err = capsys.readouterr().err
    assert "cannot roll back to default" in err and "v1 stays active" in err and "install default" not in err, err
    assert PolicyStore().active() == "v1" and (tmp_path / "store" / "history.json").read_text() == history
    monkeypatch.setattr("slurm_mig.policy_registry.SHIPPED_MODEL", SHIPPED_MODEL)
    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "default"}


def test_retrain_refuses_an_out_folder_that_holds_a_model_in_use(tmp_path, monkeypatch, capsys):
    """`policy retrain --out DIR` trains into DIR whatever the decision: DIR the active version's folder (or any
    in the store) had the running model.onnx, card and model.pt overwritten in place by the unjudged candidate,
    the controller then running it, and the candidate judged against itself; the shipped policy/ folder or a
    pinned model's folder alike. Found by retraining with --out <store>/<active version> on a filled state DB
    (the active model.onnx changed, the store listing the candidate's card under the installed name). Refused
    now before anything is trained or written."""
    st = PolicyStore()
    st.install(st.add(model_dir(tmp_path, "src", version="v1")).version)
    store = tmp_path / "store"
    files = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    db = tmp_path / "state.db"
    db.write_bytes(b"")
    pinned = model_dir(tmp_path, "pinned", version="p1")
    monkeypatch.setenv("SLURM_MIG_RL_MODEL", str(pinned / "model.onnx"))
    for out in (store / "v1", store / "new", store, SHIPPED_MODEL.parent, pinned):
        assert main(["policy", "retrain", "--db", str(db), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and "refusing" in err, err
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == files
    assert not (store / "new").exists()


def test_a_store_in_a_folder_anyone_may_write_is_refused_not_written(tmp_path, capsys):
    """/var/lib/slurm-mig made 0777 by an install under umask 0 (before 2026-11-27) stays so: anyone could rename
    the store below it away and put their own, naming the model root's controller runs. A folder above the store
    that anyone may write, and that is not sticky as /tmp is, is refused like the store itself."""
    var = tmp_path / "var"
    var.mkdir()
    var.chmod(0o777)
    root = var / "policies"
    assert main(["policy", "install", str(model_dir(tmp_path, "a", version="v1")), "--store", str(root)]) != 0
    err = capsys.readouterr().err
    assert f"lies in {var}, which anyone may write" in err and f"chmod o-w {var}" in err, err
    assert list(var.iterdir()) == []
    var.chmod(0o1777)  # sticky: others cannot rename what is not theirs
    assert run_json(capsys, "policy", "install", str(tmp_path / "a"), "--store", str(root), "--json")["active"]


def test_a_store_write_the_system_refuses_is_a_clear_error(tmp_path, capsys):
    """An OSError while changing the store (a full disk, a read-only or immutable file) came out as a Python
    traceback. Found with `chattr +i` on a temporary store's 'active' and `policy install default`: a
    PermissionError traceback from the rename. Said as an error naming the file now; the store is as it was."""
    import subprocess

    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "src", version="v1")), "--json")
    active = tmp_path / "store" / "active"
    if subprocess.run(["chattr", "+i", str(active)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not possible here (not root, or a file system without it)")
    try:
        assert main(["policy", "install", "default"]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Operation not permitted" in err and str(active) in err, err
    finally:
        subprocess.run(["chattr", "-i", str(active)], check=True)
    assert PolicyStore().active() == "v1"


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_list_of_a_store_that_is_not_there(tmp_path, capsys, json_flag):
    """`policy list --store <a folder that does not exist>` (a typo) listed an empty store, "active: default",
    exit 0, whatever the real store runs. Now it says the store does not exist and that only the shipped default
    is there, and exits 2 as the other subcommands' refusals do (`rollback` there: "nothing to roll back"); a file
    in the store's place is refused as `install` and `rollback` refuse it. Nothing is created."""
    missing = tmp_path / "no-such-store"
    assert main(["policy", "list", "--store", str(missing), *json_flag]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"policy store {missing} does not exist" in err and "shipped default" in err
    assert not missing.exists()
    assert main(["policy", "rollback", "--store", str(missing), *json_flag]) == 2  # the same status
    capsys.readouterr()
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main(["policy", "list", "--store", str(a_file), *json_flag]) == 2
    assert "is not a directory" in capsys.readouterr().err
    missing.mkdir()  # an empty store: the shipped default, active
    assert main(["policy", "list", "--store", str(missing), *json_flag]) == 0
    assert "default" in capsys.readouterr().out


def test_a_store_another_user_owns_is_refused_not_written(tmp_path, capsys):
    """A store folder another user made first (in a sticky folder such as /tmp, or one they own) was taken by
    root's `policy install`: mode 0755, sticky parent, so no mode was wrong, but its owner may put an 'active' or
    a version there, or rename root's away, and root's controller runs what it names. Found by mkdir as uid
    65534 in a 1777 folder and `policy install` as root: installed. Refused now (owned by root or by the user
    who installs, the rule the controller applies to the model it runs); nothing is written."""
    import os

    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)
    root = tmpdir / "policies"
    root.mkdir(mode=0o755)
    os.chown(root, 65534, 65534)
    src = model_dir(tmp_path, "a", version="v1")
    for argv in (["policy", "install", str(src)], ["policy", "install", "default"], ["policy", "rollback"]):
        assert main([*argv, "--store", str(root)]) != 0
        err = capsys.readouterr().err
        assert f"policy store {root} is owned by uid 65534" in err and f"chown root {root}" in err, err
    assert list(root.iterdir()) == []
    os.chown(root, 0, 0)
    assert run_json(capsys, "policy", "install", str(src), "--store", str(root), "--json")["active"]


@pytest.mark.parametrize("opened", ["model 0666", "folder 0777"])
def test_install_and_rollback_to_a_shipped_model_the_controller_refuses_are_refused(tmp_path, monkeypatch, capsys,
                                                                                   opened):
    """`policy install default` (and a rollback to default) said the shipped model was active when it was one the
    controller refuses to run (rl.model_trust_problem: a default.onnx left 0666 by a pip install under umask 0, or
    its folder world-writable): the controller's fallback then placed every job, the command having reported
    success. Found with a 0666 copy of the shipped model as SHIPPED_MODEL and `policy install default`: exit 0,
    'default' active. Refused now by the controller's own rule, naming the file and the chmod; the active version
    is kept."""
    from slurm_mig.policies.rl import model_trust_problem

    run_json(capsys, "policy", "install", str(model_dir(tmp_path, "src", version="v1")), "--json")
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in ("default.onnx", "model_card.json", "guard.onnx"):
        shutil.copy(SHIPPED_MODEL.parent / name, shipped / name)
    m = shipped / "default.onnx"
    monkeypatch.setattr("slurm_mig.policy_registry.SHIPPED_MODEL", m)
    monkeypatch.setattr("slurm_mig.policies.rl.SHIPPED_MODEL", m)
    target, mode = (m, 0o666) if opened == "model 0666" else (shipped, 0o777)
    target.chmod(mode)
    assert model_trust_problem(m)  # the controller would refuse it
    history = (tmp_path / "store" / "history.json").read_text()
    for argv in (["policy", "install", "default"], ["policy", "rollback"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"chmod o-w {target}" in err and "v1" in PolicyStore().active(), err
    assert (tmp_path / "store" / "history.json").read_text() == history
    target.chmod(0o644 if target == m else 0o755)
    assert run_json(capsys, "policy", "rollback", "--json") == {"active": "default"}


def test_retrain_fine_tunes_the_model_its_own_config_names(monkeypatch, tmp_path, capsys):
    """`slurm-mig --config X policy retrain`: X's [policy].model_path is the model the controller started with
    --config X runs (7ac67ef), so it is the one retrain compares against and fine-tunes. Until 2026-11-27 it took
    the config $SLURM_MIG_CONFIG (or /etc) names: with X naming A and that one B, it fine-tuned B, warning about A;
    and --out in A's folder was not refused."""
    pytest.importorskip("torch")
    from training.retrain import current_model

    a = model_dir(tmp_path, "a", version="va") / "model.onnx"
    b = model_dir(tmp_path, "b", version="vb") / "model.onnx"
    for name, model in (("x.toml", a), ("found.toml", b)):
        (tmp_path / name).write_text(f'[policy]\nmodel_path = "{model}"\n')
    monkeypatch.setenv("SLURM_MIG_CONFIG", str(tmp_path / "found.toml"))
    monkeypatch.setattr("slurm_mig.policies.rl._config_model_path", lambda: str(b))  # what load_config finds
    assert current_model()[:2] == (f"pinned:{b}", b)  # no --config: the config found, as the controller
    assert current_model(str(a))[:2] == (f"pinned:{a}", a)
    assert current_model("")[1] == SHIPPED_MODEL  # --config X without model_path: not B
    db = tmp_path / "state.db"
    db.write_bytes(b"")
    assert main(["--config", str(tmp_path / "x.toml"), "policy", "retrain", "--db", str(db), "--out",
                 str(a.parent)]) == 2
    assert f"--out {a.parent} is the folder of the model [policy].model_path pins" in capsys.readouterr().err


def test_list_of_the_default_store_before_any_install_shows_the_shipped_default(tmp_path, capsys, monkeypatch):
    """A fresh site (no --store, no $SLURM_MIG_POLICY_STORE, nothing installed yet) runs the shipped default, so
    `policy list` shows it (docs/rl-policy.md: its card says who places); bbcd5f9's exit 2 for a store that does
    not exist is for one someone named, where it is a typo (found by the review of the same day)."""
    monkeypatch.delenv("SLURM_MIG_POLICY_STORE", raising=False)
    missing = tmp_path / "var-lib-slurm-mig-policies"
    monkeypatch.setattr("slurm_mig.policies.rl.DEFAULT_STORE", missing)
    assert main(["policy", "list"]) == 0
    out = capsys.readouterr().out
    assert "default" in out and "places:" in out, out
    assert run_json(capsys, "policy", "list", "--json")["active"] == "default"
    assert not missing.exists()
    missing.write_text("")  # a file in its place is still refused
    assert main(["policy", "list"]) == 2
    assert "is not a directory" in capsys.readouterr().err
