"""Mode-specific behaviour: AQ-SGD warm-up in the pipeline, non-finite skipping inside a mode,
compressed_mean data parallelism."""

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _trainer


def _pipeline_config(make_config, **pipeline):
    return make_config(
        mode="pipeline",
        mesh=[("stage", 4)],
        model={"hidden": (16, 16, 16)},
        batch_size=32,
        eval_batch_size=32,
        pipeline={"num_microbatches": 4, **pipeline},
    )


def _place(s, batch):
    return _trainer.place(batch, s.mode.batch_sharding)


def _key(s, i):
    return _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(i))), s.mesh)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_aq_sgd_warm_up_fills_the_caches_then_compresses(make_config):
    config = _pipeline_config(
        make_config,
        forward={"name": "quantize", "bits": 4, "scale": "feature", "feedback": "aq_sgd"},
        backward={"name": "quantize", "bits": 8},
        warmup_epochs=1,
    )
    s = train.setup(config)
    steps_per_epoch = s.train_loader.steps_per_epoch
    state = s.mode.init(jax.random.key(0))
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    state, m0 = s.mode.train_step(state, _place(s, batch), _key(s, 0), 0)  # warm-up: dense
    cache = np.asarray(state.link_states.ends()[0].forward.send.estimate)  # [samples, 16]
    filled = np.flatnonzero(np.abs(cache).sum(axis=1))
    np.testing.assert_array_equal(np.sort(filled), np.sort(batch["ids"]))
    state, m1 = s.mode.train_step(state, _place(s, batch), _key(s, 1), steps_per_epoch)
    assert m0["finite"] == 1 and m1["finite"] == 1
    assert s.mode.wire_bytes < s.mode.dense_bytes


def test_non_finite_batch_leaves_the_pipeline_state_unchanged(make_config):
    config = _pipeline_config(
        make_config, forward={"name": "top_k", "fraction": 0.25, "feedback": "ef"}
    )
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    before = _leaves(state)
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    batch["x"] = batch["x"].copy()
    batch["x"][3, 5] = np.nan
    state, metrics = s.mode.train_step(state, _place(s, batch), _key(s, 0), 0)
    assert int(metrics["finite"]) == 0
    for a, b in zip(before, _leaves(state)):
        np.testing.assert_array_equal(a, b)


def test_compressed_mean_data_parallel_sends_less_than_dense(make_config, tmp_path):
    config = make_config(
        mode="data_parallel",
        optax_name="sgd",
        lr=0.1,
        total_steps=3,
        log_every=1,
        data_parallel={
            "transform": "compressed_mean",
            "codec": {"name": "top_k", "fraction": 0.05, "feedback": "ef"},
        },
    )
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert 0 < summary["wire_bytes_per_step"] < summary["dense_bytes_per_step"] / 3
    assert summary["reducer"].startswith("compressed_mean(error_feedback(top_k(0.05")
    # per collective kind, from the compiled step: no branch, every step the same; what the
    # transform counts plus the loss and accuracy means (2 x 4 bytes)
    recs = summary["collectives"]
    assert recs and not any(r["conditional"] for r in recs)
    assert {r["group_size"] for r in recs} == {8}
    total = sum(r["bytes_per_execution"] * r["executions"] for r in recs)
    assert total == summary["wire_bytes_per_step"] + 8


@pytest.mark.parametrize("mode", ["dense", "data_parallel", "pipeline"])
def test_a_step_whose_optimizer_state_overflows_is_skipped(make_config, mode, monkeypatch):
    """A batch of 1e20s gives finite gradients whose squares overflow: Adam's second moment
    becomes inf while its update (m / sqrt(v) = 0) leaves the parameters finite. Committed,
    those weights would silently never move again; the step is skipped and says so.

    On the way: the mode's state init (``_mode.jit_init``, split in two programs) gives the
    bits of ``jax.jit`` of the same function with the same ``out_shardings`` (the AB mode's
    ``jit_init(model.init)`` is the digits MLP's of tests/test_init_program.py)."""
    from jaxcomp.train import _mode

    inits = []
    real = _mode.jit_init

    def recording(fn, **jit_kwargs):
        inits.append((fn, jit_kwargs, real(fn, **jit_kwargs)))
        return inits[-1][2]

    monkeypatch.setattr(_mode, "jit_init", recording)
    extra = {
        "dense": {},
        "data_parallel": {
            "data_parallel": {"transform": "compressed_mean", "codec": {"name": "identity"}}
        },
        "pipeline": {
            "mesh": [("stage", 4)],
            "model": {"hidden": (16, 16, 16)},
            "pipeline": {"num_microbatches": 4},
        },
    }[mode]
    # adam at the default lr: the dense step is the one test_no_stall and test_trainer compile
    config = make_config(mode=mode, optax_name="adam", **extra)
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    before = _leaves(state)
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    batch["x"] = np.full_like(batch["x"], 1e20)
    new, metrics = s.mode.train_step(state, _place(s, batch), _key(s, 0), 0)
    assert np.isfinite(float(metrics["loss"]))
    assert int(metrics["finite"]) == 0
    for a, b in zip(before, _leaves(new), strict=True):
        np.testing.assert_array_equal(a, b)
    assert inits
    for fn, jit_kwargs, split in inits:
        assert split.lower(jax.random.key(0)).plain is None  # the split program
        got, want = split(jax.random.key(0)), jax.jit(fn, **jit_kwargs)(jax.random.key(0))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
