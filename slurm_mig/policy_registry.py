"""The policy store: versions of the learned ``rl`` policy, which one is active, and its history.

Layout (default /var/lib/slurm-mig/policies, or $SLURM_MIG_POLICY_STORE, or ``--store``)::

    <store>/<version>/model.onnx        the scorer the controller runs (onnxruntime)
    <store>/<version>/model_card.json   feature schema, training data, metrics
    <store>/<version>/model.pt          torch weights, for fine-tuning (optional; plain tensors only; copied
                                        from the <name>.pt beside the <name>.onnx installed)
    <store>/active                      the active version ("default" or absent: the shipped model)
    <store>/history.json                every activation, newest last (what rollback walks back)

``install`` checks that the model loads with onnxruntime and matches this
slurm-mig's feature schema before making it active; the controller's ``rl``
policy picks the change up within seconds (it re-resolves its model file). The
shipped model (policy/default.onnx) is the version called ``default``.
No torch here: this module runs on the head node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickletools
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from slurm_mig.errors import ConfigError
from slurm_mig.folders import make_missing_folders, sync_path, writable_by_others, write_durably
from slurm_mig.policies.rl import (
    CARD_NAME, SHIPPED_MODEL, VERSION_RE, OnnxScorer, PolicyModelError, created_time, model_trust_problem,
    read_active, read_card, store_dir,
)

DEFAULT = "default"
# Names of the store's own files, which fit VERSION_RE: a version so named was added as a folder in their place
# (then "active" or "history.json" could not be written or read, and the store stopped until fixed by hand)
STORE_FILES = ("active", "history.json")

# The store's folders and files, whatever the umask or the mode of the files installed: root's controller runs the
# model ``active`` names, so nobody else may write either; anyone may read them (`policy list`).
FOLDER_MODE = 0o755
FILE_MODE = 0o644

# What a torch.save of plain weights names in its pickle: a stricter subset of what
# torch.load(weights_only=True) accepts, checked without torch (the head node has none).
_WEIGHT_GLOBALS = {"collections OrderedDict", "torch._utils _rebuild_tensor_v2", "torch._utils _rebuild_parameter"} | {
    f"torch {t}Storage" for t in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte",
                                  "Bool")}
# Opcodes that name a callable from the stack or a registry: a static check cannot tell what they call.
_UNCHECKABLE_OPS = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}


def check_weights(pt: Path) -> None:
    """Refuse a model.pt that is more than tensors, dicts, lists and numbers.

    ``policy retrain`` fine-tunes from the active version's model.pt as root;
    a pickle that names any other callable could run code when loaded."""
    try:
        with zipfile.ZipFile(pt) as z:
            pkls = [n for n in z.namelist() if n.endswith("/data.pkl")]
            if len(pkls) != 1:
                raise ConfigError(f"{pt}: not a torch checkpoint (no single data.pkl inside); "
                                  "move it out of the folder or re-save it with torch.save(<dict of tensors>)")
            data = z.read(pkls[0])
    except (OSError, zipfile.BadZipFile, RuntimeError) as exc:
        raise ConfigError(f"{pt}: not a torch checkpoint ({exc}); move it out of the folder or re-save it "
                          "with torch.save(<dict of tensors>)") from None
    try:
        for op, arg, _pos in pickletools.genops(data):
            bad = op.name if op.name in _UNCHECKABLE_OPS else None
            if op.name == "GLOBAL" and arg not in _WEIGHT_GLOBALS:
                bad = str(arg).replace(" ", ".")
            if bad:
                raise ConfigError(f"{pt} holds more than plain weights (it names {bad}); refusing it: loading it "
                                  "could run code. Re-save it with torch.save(<dict of tensors>) or leave it out")
    except ValueError as exc:  # pickletools' word for a truncated or corrupt pickle
        raise ConfigError(f"{pt}: corrupt pickle ({exc})") from None


@dataclass
class PolicyVersion:
    version: str
    path: Path  # the .onnx file
    card: dict
    active: bool = False

    def to_json(self) -> dict:
        c = self.card
        return {"version": self.version, "active": self.active, "path": str(self.path),
                "created": c.get("created"), "feature_schema": c.get("feature_schema"),
                "source": c.get("source", "training/train.py"), "metrics": c.get("metrics", {}),
                "wall_time_s": c.get("wall_time_s"), "validation_wait_ratio_vs_frag_aware":
                    c.get("validation_wait_ratio_vs_frag_aware")}


class PolicyStore:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else store_dir()

    # -- reading -----------------------------------------------------------------------
    def active(self) -> str:
        """The active version; ``default`` without an ``active`` file, '' when it names none (see
        :meth:`active_problem`)."""
        try:
            return read_active(self.root) or DEFAULT
        except PolicyModelError:
            return ""

    def active_problem(self) -> str:
        """Why ``active`` names no version ('' when it does): the controller then runs its fallback."""
        try:
            read_active(self.root)
        except PolicyModelError as exc:
            return str(exc)
        return ""

    def history(self) -> list[dict]:
        """Every activation, oldest first; a history.json that is not that is an error, not an empty
        history (rewriting it would lose what it holds)."""
        self.check_not_a_file()
        path = self.root / "history.json"
        try:
            h = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # no store yet (or none possible: said when writing)
            return []
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}; fix or remove it") from None
        if not isinstance(h, list) or not all(isinstance(e, dict) and isinstance(e.get("version"), str) for e in h):
            raise ConfigError(f"{path} is not a list of {{\"version\": ..., \"time\": ...}} entries; fix or remove it")
        return h

    def versions(self) -> list[PolicyVersion]:
        """The shipped default first, then stored versions oldest first."""
        act = self.active()
        out = []
        if SHIPPED_MODEL.is_file():
            try:
                card = read_card(SHIPPED_MODEL)
            except PolicyModelError:
                card = {}
            out.append(PolicyVersion(DEFAULT, SHIPPED_MODEL, card, act == DEFAULT))
        stored = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                m = d / "model.onnx"
                if VERSION_RE.fullmatch(d.name) and d.is_dir() and m.is_file():
                    try:
                        card = read_card(m)
                    except PolicyModelError:
                        card = {}
                    stored.append(PolicyVersion(d.name, m, card, act == d.name))
        stored.sort(key=lambda v: (created_time(v.card) or 0, v.version))
        return out + stored

    def get(self, version: str) -> PolicyVersion:
        for v in self.versions():
            if v.version == version:
                return v
        known = ", ".join(v.version for v in self.versions()) or "none"
        raise ConfigError(f"no policy version {version!r} in {self.root} (known: {known})")

    # -- writing -----------------------------------------------------------------------
    def add(self, source: str | Path, version: str | None = None, *, extra_card: dict | None = None) -> PolicyVersion:
        """Copy a model (an .onnx with its card beside it, or a folder holding model.onnx) into the store."""
        src = Path(source)
        onnx = src / "model.onnx" if src.is_dir() else src
        if not onnx.is_file():
            raise ConfigError(f"{source}: no model.onnx to add")
        card = read_card(onnx)
        OnnxScorer(onnx)  # refuses a model this slurm-mig cannot run
        # The weights of this model: <name>.pt beside <name>.onnx (model.pt for model.onnx, default.pt for the
        # shipped default.onnx, as training/guard.py pairs them). Not any model.pt beside it: installing x.onnx
        # from a folder that also held model.onnx and its model.pt stored that other model's weights as this
        # version's, and `policy retrain` fine-tuned from them.
        pt = onnx.with_suffix(".pt")
        if pt.is_file():
            check_weights(pt)
        version = version or str(card.get("version") or time.strftime("%Y%m%d-%H%M%S"))
        if not VERSION_RE.fullmatch(version) or version == DEFAULT or version in STORE_FILES:
            raise ConfigError(f"bad policy version name {version!r}" + (
                " (the name of the store's own file, or of the shipped model): set another \"version\" in its card"
                if version == DEFAULT or version in STORE_FILES else ""))
        dest = self.root / version
        if dest.exists():
            raise ConfigError(f"policy version {version} already exists in {self.root}")
        with self._locked():
            if dest.exists():  # added meanwhile by another admin
                raise ConfigError(f"policy version {version} already exists in {self.root}")
            return self._add(onnx, pt, card, version, dest, extra_card)

    def _add(self, onnx: Path, pt: Path, card: dict, version: str, dest: Path, extra_card: dict | None
             ) -> PolicyVersion:
        tmp = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=self.root))  # 0700 until complete
        try:
            # copyfile, not copy2: the files take FILE_MODE, never the mode of those installed (0666 from a folder so
            # written)
            shutil.copyfile(onnx, tmp / "model.onnx")
            guard = card.get("guard")
            if isinstance(guard, dict) and guard.get("file"):  # OnnxScorer checked it is a plain name beside it
                shutil.copyfile(onnx.parent / guard["file"], tmp / guard["file"])
            card = {**card, **(extra_card or {}), "version": version}
            (tmp / CARD_NAME).write_text(json.dumps(card, indent=2) + "\n")
            if pt.is_file():
                shutil.copyfile(pt, tmp / "model.pt")
            for f in tmp.iterdir():
                os.chmod(f, FILE_MODE)
                sync_path(f)  # each file on disk before its folder is renamed into place: never a version of empty files
            try:
                # The copy, not the source, is what the controller will run: a model that loaded where it was given
                # may not load here (its weights in a file beside it that is not copied: ONNX external data)
                OnnxScorer(tmp / "model.onnx")
            except PolicyModelError as exc:
                raise ConfigError(f"{onnx}: its copy in the store would not load, so nothing was added ({exc}); "
                                  "a model must be one .onnx file (weights inside it, not in ONNX external data "
                                  "files), its card, model.pt and the guard the card names") from None
            os.chmod(tmp, FOLDER_MODE)
            sync_path(tmp)
            os.replace(tmp, dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        sync_path(self.root)  # the rename itself
        return PolicyVersion(version, dest / "model.onnx", card, False)

    def install(self, version: str) -> PolicyVersion | None:
        """Make ``version`` active (after checking it loads and matches the feature schema). ``default``, the
        shipped model, is checked too: activated unchecked, a damaged or missing policy/default.onnx made the
        controller's rl policy fail every tick, its fallback deciding. Returns the version (None for ``default``)."""
        v = None if version == DEFAULT else self.get(version)
        problem = self._unusable(SHIPPED_MODEL if v is None else v.path)
        if problem:
            raise ConfigError(f"policy version {version} cannot be used: {problem}") from None
        self.activate(version)
        if v is not None:
            v.active = True
        return v

    @staticmethod
    def _unusable(model: Path) -> str:
        """Why the controller would not run ``model`` ('' when it would): it does not load (or not with this
        slurm-mig's feature schema), or others than root may change one of its files (rl.model_trust_problem, the
        controller's own rule: the shipped model too, which a pip install under umask 0 can leave 0666). Activated
        so, the command said so while the controller's fallback placed every job."""
        problem = model_trust_problem(model)
        if problem:
            return f"the controller refuses to run it: {problem}; nothing was changed"
        try:
            OnnxScorer(model)
        except PolicyModelError as exc:
            return str(exc)
        return ""

    def activate(self, version: str) -> None:
        """Make ``version`` the active one and add it to the history; no check (see :meth:`install`)."""
        with self._locked():
            h = self.history()  # first: a broken history.json refuses the change instead of half-making it
            self._set_active(version)
            h.append({"version": version, "time": time.time()})
            self._write_json("history.json", h)

    def rollback(self) -> str:
        """Re-activate the version that was active before the current one (``default`` at the start); a
        ConfigError when there is none (the shipped model active, no earlier activation)."""
        self.check_not_a_file()
        if not self.root.exists() and next((p for p in self.root.parents if p.exists()), Path("/")).is_dir():
            # no store: nothing was ever installed, and a rollback that changes nothing makes none
            raise ConfigError(self._nothing_to_roll_back(DEFAULT))
        with self._locked():
            return self._rollback()

    def _nothing_to_roll_back(self, cur: str) -> str:
        return (f"nothing to roll back: {cur} is active{' (the shipped model)' if cur == DEFAULT else ''} and "
                f"{self.root / 'history.json'} holds no activation before it; `slurm-mig policy list` shows the "
                "versions, `slurm-mig policy install VERSION` activates one")

    def _rollback(self) -> str:
        h = self.history()
        problem = self.active_problem()
        if problem:  # which version ran before is unknown: going back from it would be a guess
            last = f" (the history's last activation: {h[-1]['version']})" if h else ""
            raise ConfigError(f"cannot roll back: {problem}{last}")
        cur = self.active()
        while h and h[-1]["version"] == cur:
            h.pop()
        prev = h[-1]["version"] if h else DEFAULT
        if prev == cur:  # (default active, no activation left in the history): "rolled back" would be a lie
            raise ConfigError(self._nothing_to_roll_back(cur))
        stored = {v.version for v in self.versions()}
        # Refused, not skipped, when ``prev`` is gone or no longer loads: the version before it may be one the
        # admin moved away from on purpose.
        if prev != DEFAULT and prev not in stored:
            raise ConfigError(f"cannot roll back to {prev}: {self.root / prev} is gone or holds no model.onnx; "
                              f"{self._instead(h, stored, cur, prev)}")
        # install's check: a version whose card or model.onnx changed since it ran (another feature schema,
        # a damaged file) would make the controller's rl policy fail every tick, its fallback deciding; the
        # shipped model too, as `install default` checks it (a broken package)
        problem = self._unusable(SHIPPED_MODEL if prev == DEFAULT else self.root / prev / "model.onnx")
        if problem:
            raise ConfigError(f"cannot roll back to {prev}: it cannot be used: {problem}; "
                              f"{self._instead(h, stored, cur, prev)}")
        # History first: stopped between the two writes, the store still runs ``cur`` and the next rollback
        # (its entries popped) goes to ``prev`` again; the other order left ``prev`` active with ``cur`` last in
        # the history, and the next rollback re-activated ``cur``, the version rolled back from.
        self._write_json("history.json", h)
        self._set_active(prev)
        return prev

    def _instead(self, h: list[dict], stored: set[str], cur: str, prev: str) -> str:
        """What a refused rollback says to do instead: the history's earlier versions still stored, the
        shipped model, list; and that ``cur`` stays active."""
        earlier: list[str] = []
        for e in reversed(h):
            if e["version"] in stored and e["version"] not in earlier + [cur, prev, DEFAULT]:
                earlier.append(e["version"])
        how = (f"`slurm-mig policy install {earlier[0]}` activates the one before it in the history"
               f"{' (then ' + ', '.join(earlier[1:3]) + ')' if earlier[1:] else ''}, " if earlier else "")
        # the shipped model, unless it is the one refused
        shipped = "" if prev == DEFAULT else "`slurm-mig policy install default` the shipped model, "
        return f"{how}{shipped}`slurm-mig policy list` shows every version; {cur} stays active"

    @contextlib.contextmanager
    def _locked(self):
        """Hold the store's lock file (``.lock``, an exclusive flock) while changing the store, after making the
        store and checking it can be written (_writable_root): each change reads history.json (or checks a
        version is new) and writes it back, so two at once (two admins, or a `retrain --install` finishing
        meanwhile) lost an activation (and, while the temporary files had fixed names, before write_durably,
        overwrote each other's and failed with a traceback). A second one waits for the first."""
        self._writable_root()
        try:
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
        except OSError as exc:
            raise ConfigError(f"cannot open the policy store's lock {self.root / '.lock'}: "
                              f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        except OSError as exc:  # a full disk, a read-only or immutable file: an error, not a traceback
            where = f" ({exc.filename} -> {exc.filename2})" if exc.filename2 else (f" ({exc.filename})" if exc.filename
                                                                                   else "")
            raise ConfigError(f"policy store {self.root}: the change stopped: {exc.strerror or exc}{where}; each file "
                              "there is replaced whole or not at all: `slurm-mig policy list` shows what is active"
                              ) from None
        finally:
            os.close(fd)  # releases the lock

    def _writable_root(self) -> None:
        """The store directory, created if missing; a ConfigError naming it when it cannot be written."""
        self.check_not_a_file()
        # Before anything is made, and again after: the store, or a folder above it that is not sticky (as /tmp),
        # writable by anyone (made so before 2026-11-27 under umask 0, or by hand) lets anyone put an 'active' or
        # a version there, or rename the store away and put their own, that root's controller would run. The
        # controller refuses to run such a model by the same rule (rl.model_trust_problem).
        self._trusted_root()
        try:
            # each made with FOLDER_MODE, then chmod-ed: mkdir(parents=True) gave 0777 less the umask, world-writable
            # under umask 0 (and /var/lib/slurm-mig, made first by an install, stayed so for the database)
            for d in make_missing_folders(self.root, lambda d: FOLDER_MODE):
                sync_path(d.parent)  # a store made here survives a power cut with what goes in it
        except OSError as exc:
            raise ConfigError(f"policy store {exc.filename or self.root} cannot be created: "
                              f"{exc.strerror or exc}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"policy store {self.root} is not writable by this user (run as root, or use --store)")
        self._trusted_root()

    def _trusted_root(self) -> None:
        problem = writable_by_others(self.root, "policy store")
        if problem:
            raise ConfigError(f"{problem}; nothing was changed")

    def check_listable(self) -> None:
        """ConfigError (exit 2, as the other subcommands' refusals) when there is no store folder to list: none at
        all (a mistyped --store read as an empty store: "active: default", exit 0, whatever the real store runs),
        or a file in its place."""
        self.check_not_a_file()
        if not self.root.exists():
            raise ConfigError(f"policy store {self.root} does not exist (nothing was ever installed there): the only "
                              f"version is the shipped default, {SHIPPED_MODEL}. Check --store or "
                              "$SLURM_MIG_POLICY_STORE; `slurm-mig policy install` creates the store")

    def check_not_a_file(self) -> None:
        """ConfigError when a file stands where the store's folder should be."""
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"policy store {self.root} is not a directory (use --store or $SLURM_MIG_POLICY_STORE "
                              "to name another)")

    def _set_active(self, version: str) -> None:
        # (under _locked, which made the store and checked it can be written)
        write_durably(self.root / "active", (version + "\n").encode(), FILE_MODE)

    def _write_json(self, name: str, data) -> None:
        # fsynced before and after the rename (folders.write_durably): a power cut must not leave an empty
        # 'active' (the controller would run another model) or history.json
        write_durably(self.root / name, (json.dumps(data, indent=1) + "\n").encode(), FILE_MODE)
