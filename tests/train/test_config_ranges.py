"""Every numeric config key is checked by sign and range before anything compiles, and the
cosine schedules' horizon is part of the experiment (issue 37, item 5).

A negative learning rate or clipping norm trained uphill and exited 0; ``log_every=0``,
``pipeline.num_microbatches=0``, ``seed=-1`` and an ``eval_batch_size`` the devices do not
divide failed after compiling with an error that did not name the key. Resuming a cosine run
with another ``total_steps`` changed every step's learning rate without a word, and raising
``total_steps`` to "continue" a finished one restarted the decay.
"""

import functools

import jax
import pytest

from jaxcomp import train

PIPELINE = {
    "mode": "pipeline",
    "mesh": [("stage", 4)],
    "model": {"hidden": (16, 16, 16)},
    "batch_size": 32,
    "eval_batch_size": 32,
}


@pytest.fixture
def no_compiling(monkeypatch):
    """Any compile fails the test: the error must come first."""

    def compile(self, *a, **k):
        raise AssertionError("a program was compiled before the config error")

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"lr": -0.001}, r"config.lr must be a finite number > 0; got -0.001\."),
        ({"lr": float("inf")}, r"config.lr must be a finite number > 0; got inf\."),
        ({"grad_clip_norm": -1}, r"config.grad_clip_norm must be None or a finite number > 0"),
        ({"grad_clip_norm": 0}, r"config.grad_clip_norm must be None or a finite number > 0"),
        ({"weight_decay": -1e-4}, r"config.weight_decay must be a finite number >= 0"),
        ({"log_every": 0}, r"config.log_every must be an integer >= 1; got 0\."),
        ({"eval_every": -1}, r"config.eval_every must be an integer >= 0; got -1\."),
        ({"checkpoint_every": -5}, r"config.checkpoint_every must be an integer >= 0; got -5"),
        ({"keep_checkpoints": 0}, r"config.keep_checkpoints must be an integer >= 1"),
        ({"max_nonfinite_in_a_row": 0}, r"config.max_nonfinite_in_a_row must be an integer >= 1"),
        ({"seed": -1}, r"config.seed must be an integer >= 0 and <= 4294967295; got -1\."),
        ({"warmup_steps": -3}, r"config.warmup_steps must be an integer >= 0; got -3\."),
        ({"lr_decay_steps": [5, 0]}, r"config.lr_decay_steps\[1\] must be an integer >= 1"),
        ({"eval_batch_size": 0}, r"config.eval_batch_size must be None or an integer >= 1"),
        ({"schedule_steps": 0}, r"config.schedule_steps must be None or an integer >= 1"),
        ({"schedule_steps": 10}, r"config.schedule_steps is the horizon of the cosine sched"),
        ({"eval_batch_size": 1}, r"config.eval_batch_size \(1\) is not divisible by the 8 dev"),
        ({"batch_size": 60}, r"config.batch_size \(60\) is not divisible by the 8 devices"),
        (
            {**PIPELINE, "pipeline": {"num_microbatches": 0}},
            r"config.pipeline.num_microbatches must be an integer >= 1; got 0\.",
        ),
        (
            {**PIPELINE, "pipeline": {"warmup_epochs": -1}},
            r"config.pipeline.warmup_epochs must be an integer >= 0; got -1\.",
        ),
        (
            {"mode": "data_parallel", "eval_batch_size": 4},
            r"config.eval_batch_size \(4\) is not divisible by 8 workers",
        ),
        ({"mode": "ab", "eval_batch_size": 4}, r"config.eval_batch_size \(4\) is not divisible"),
    ],
)
def test_a_number_out_of_range_is_named_before_compiling(
    make_config, tmp_path, no_compiling, overrides, match
):
    work = tmp_path / "run"
    with pytest.raises(train.SetupError, match=match) as info:
        train.train_and_evaluate(make_config(**overrides), str(work))
    assert "\n" not in str(info.value)
    assert not work.exists(), "a refused run left the workdir it created"


def test_a_refused_run_keeps_a_workdir_it_did_not_create(make_config, tmp_path, no_compiling):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(train.SetupError, match="num_microbatches"):
        train.train_and_evaluate(
            make_config(**PIPELINE, pipeline={"num_microbatches": 0}), str(tmp_path)
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(train.SetupError, match="num_microbatches"):
        train.train_and_evaluate(
            make_config(**PIPELINE, pipeline={"num_microbatches": 0}), str(empty)
        )
    assert empty.is_dir()


@pytest.mark.slow  # 7 short runs of 4 configs
@pytest.mark.usefixtures("fast_compiles", "shared_setups")  # messages and rates, no bits
def test_the_cosine_horizon_is_part_of_the_experiment(make_config, tmp_path, capsys):
    """Resuming with another total_steps is refused naming the horizon, before compiling;
    a finished cosine run is not 'continued' by raising total_steps; the explicit horizon
    continues it at the schedule's end value; constant schedules extend freely."""
    make_config = functools.partial(make_config, model=dict(hidden=(16,)))  # 4 setups: small
    cosine = make_config(schedule="cosine", total_steps=8, log_every=4, checkpoint_every=4)
    work = tmp_path / "cos"
    train.train_and_evaluate(cosine, str(work))
    capsys.readouterr()
    # rerunning the finished run: no advice to raise total_steps
    train.train_and_evaluate(cosine, str(work))
    out = capsys.readouterr().out
    assert "is finished (8 of 8 steps)" in out and "Raise total_steps" not in out, out
    assert "schedule ends at step 8" in out, out
    longer = make_config(schedule="cosine", total_steps=12, log_every=4, checkpoint_every=4)
    with pytest.raises(train.SetupError, match=r"schedule_steps") as info:
        train.train_and_evaluate(longer, str(work))
    text = str(info.value)
    assert "ends at step 8" in text and "ends at step 12" in text and "\n" not in text, text
    assert "--set schedule_steps=8" in text, text
    # the explicit horizon continues the run: the learning rate stays at its end value (0)
    longer.schedule_steps = 8
    summary = train.train_and_evaluate(longer, str(work))
    assert summary["steps"] == 12
    rates = [train.learning_rate(train.with_defaults(longer))(s) for s in (0, 4, 8, 11)]
    assert float(rates[0]) == pytest.approx(3e-3) and float(rates[1]) < float(rates[0])
    assert float(rates[2]) == float(rates[3]) == 0.0
    # a constant schedule's total_steps stays a run length: raised, the run goes on
    const = tmp_path / "const"
    train.train_and_evaluate(make_config(total_steps=4, checkpoint_every=4), str(const))
    capsys.readouterr()
    train.train_and_evaluate(make_config(total_steps=4, checkpoint_every=4), str(const))
    assert "Raise total_steps to continue it" in capsys.readouterr().out
    again = train.train_and_evaluate(make_config(total_steps=8, checkpoint_every=4), str(const))
    assert again["steps"] == 8
