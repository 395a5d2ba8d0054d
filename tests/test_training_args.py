"""training/args.py: one command-line parser for the training scripts' argument dataclasses."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("torch")  # training/ imports torch; the runtime never does

from training.args import field_docs, parse_args  # noqa: E402


@dataclass
class Demo:
    out: str = "runs/#1"  # where it goes (a "#" inside the default is not the comment)
    steps: int = 10  # how many steps, 55 % of them warm-up
    rate: float = 0.5
    smoke: bool = False  # tiny run
    jobs: tuple[int, int] = (250, 500)  # jobs per episode
    shares: tuple[float, ...] = (0.0, 0.05)  # multi-GPU shares
    names: tuple[str, ...] = ("poisson", "rl-mix_soft")  # families


def test_each_fields_comment_is_its_doc():
    docs = field_docs(Demo)
    assert docs["out"] == 'where it goes (a "#" inside the default is not the comment)'
    assert docs["steps"] == "how many steps, 55 % of them warm-up"
    assert "rate" not in docs
    assert docs["jobs"] == "jobs per episode"


def test_defaults_and_values_keep_their_types():
    assert parse_args(Demo, []) == Demo()
    a = parse_args(Demo, ["--steps", "3", "--rate", "0.25", "--smoke", "--jobs", "60,90",
                          "--shares", "0.1,0.2,0.3", "--names", "alibaba-early", "--out", "x"])
    assert a == Demo(out="x", steps=3, rate=0.25, smoke=True, jobs=(60, 90), shares=(0.1, 0.2, 0.3),
                     names=("alibaba-early",))
    assert all(isinstance(v, int) for v in a.jobs) and all(isinstance(v, float) for v in a.shares)


@pytest.mark.parametrize("argv", [["--jobs", "60,x"], ["--steps", "many"], ["--nope", "1"]])
def test_bad_values_are_refused_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Demo, argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_shows_the_comments_and_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(Demo, ["--help"], "demo")
    out = " ".join(capsys.readouterr().out.split())
    assert "how many steps, 55 % of them warm-up (default 10)" in out
    assert "jobs per episode (comma-separated; default 250,500)" in out


def test_the_training_scripts_parse_through_it():
    from training.guard import Args as GuardArgs
    from training.modes import parse_args as modes_args
    from training.train import parse_args as train_args

    a = train_args(["--episode-jobs", "100,200", "--families", "poisson", "--lr", "1e-3"])
    assert (a.episode_jobs, a.families, a.lr) == ((100, 200), ("poisson",), 1e-3)
    assert train_args(["--smoke"]).episode_jobs == (60, 90)  # the smoke run's own sizes still win
    m = modes_args(["--multi-shares", "0.1,0.2"])
    assert m.multi_shares == (0.1, 0.2)
    g = parse_args(GuardArgs, ["--episodes", "8", "--smoke"])
    assert (g.episodes, g.smoke, g.alibaba_share) == (8, True, 0.25)


def test_train_without_the_trace_refuses_alibaba_early_before_training(monkeypatch, tmp_path, capsys):
    """Without the Alibaba trace, a run whose families include alibaba-early stops at once with what to
    do, instead of failing minutes in at the first alibaba-early episode."""
    pytest.importorskip("torch")
    import training.splits as splits
    import training.train as train_mod

    monkeypatch.setattr(splits, "default_trace", lambda: None)
    started = []
    monkeypatch.setattr(train_mod, "train", lambda args, **kw: started.append(args))
    rc = train_mod.main(["--out", str(tmp_path / "run"), "--families", "poisson,alibaba-early"])
    assert rc == 2 and not started
    assert "--trace" in capsys.readouterr().err
    assert train_mod.main(["--out", str(tmp_path / "run"), "--families", "poisson"]) == 0
    assert len(started) == 1
