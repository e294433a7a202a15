"""Mode-specific behaviour: compressed_mean data parallelism, the modes' state inits (AQ-SGD's
warm-up: test_pipeline_keys.py; non-finite steps in every mode: test_nonfinite.py)."""

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.train import _dense
from jaxcomp.train import _dp_mode
from jaxcomp.train import _pipeline_mode
from jaxcomp.train import _trainer


def _place(s, batch):
    return _trainer.place(batch, s.mode.batch_sharding)


def _key(s, i):
    return _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(i))), s.mesh)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
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


@pytest.mark.user_numerics
@pytest.mark.parametrize(
    "mode",
    ["dense", pytest.param("pipeline", marks=pytest.mark.slow)],
)
def test_the_modes_state_init_has_the_bits_of_jax_jit(make_mode_config, mode, monkeypatch):
    """The mode's state init (``_mode.jit_init``, split in two programs) gives the bits of
    ``jax.jit`` of the same function with the same ``out_shardings`` (the data-parallel and AB
    modes' ``jit_init(model.init)``, no ``out_shardings``, is the digits MLP's of
    tests/_cpu/test_init_program.py: the same program, pinned there). The configs:
    test_nonfinite.py's (the same programs). The setup stops at its ``compile_all``, after
    every ``jit_init``: the step and evaluation programs (seconds of compiles in the pipeline
    mode) pin nothing here; an init compiled beside them is test_init_program.py's
    ``test_a_call_after_compile_all_compiles_and_traces_nothing``."""
    from jaxcomp.train import _mode

    inits = []
    real = _mode.jit_init

    def recording(fn, **jit_kwargs):
        inits.append((fn, jit_kwargs, real(fn, **jit_kwargs)))
        return inits[-1][2]

    class _Stop(Exception):
        pass

    def stop(programs):
        raise _Stop(sorted(programs))

    monkeypatch.setattr(_mode, "jit_init", recording)
    for module in (_dense, _dp_mode, _pipeline_mode):
        monkeypatch.setattr(module, "compile_all", stop)
    with pytest.raises(_Stop, match="'init'"):  # it reached compile_all with the init
        train.setup(make_mode_config(mode))
    assert inits
    for fn, jit_kwargs, split in inits:
        assert split.lower(jax.random.key(0)).plain is None  # the split program
        got, want = split(jax.random.key(0)), jax.jit(fn, **jit_kwargs)(jax.random.key(0))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
            a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
