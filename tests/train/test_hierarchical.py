"""The trainer on hierarchical meshes from ``config.mesh``: two data axes read as (slow, fast).
A few steps over a 2 x 4 mesh == the flat 8-worker run where the math says so (identity
codec); the step metrics hold the bytes per axis; what the pair does not support is named."""

import jax
import numpy as np
import pytest

from jaxcomp import train
from jaxcomp.comm import _reduce_shards
from jaxcomp.train import _trainer

#: the (slow, fast) pair == the flat axis to tolerances, bytes and collective group sizes: no bit of
#: XLA's optimised programs is pinned; compiled unoptimised, the steps compile faster
pytestmark = pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")

IDENTITY = {"transform": "compressed_mean", "codec": {"name": "identity"}}
POWER_SGD = {"transform": "compressed_mean", "codec": {"name": "power_sgd", "rank": 1}}
ACCORDION = {"transform": "accordion", "low": {"name": "power_sgd", "rank": 2},
             "high": {"name": "power_sgd", "rank": 1}}  # fmt: skip


def _dp(make_config, mesh, reducer, **kw):
    # one hidden layer: two kernels to compress, each leaf's codec traced once per program
    kw = {"model": {"hidden": (32,)}, **kw}
    return make_config(mode="data_parallel", mesh=mesh, optax_name="sgd", lr=0.1,
                       data_parallel=reducer, **kw)  # fmt: skip


def _pipe(make_config, mesh, replica_mean):
    return make_config(
        mode="pipeline", mesh=mesh, model={"hidden": (16,)}, batch_size=32, eval_batch_size=32,
        optax_name="sgd", lr=0.1, pipeline={"num_microbatches": 4, "replica_mean": replica_mean},
    )  # fmt: skip


def _run(config, steps=3):
    """``(setup, [metrics per step], params)`` of ``steps`` training steps from seed 0."""
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    data_state = s.train_loader.initial_state()
    out = []
    for i in range(steps):
        batch, data_state = s.train_loader.next(data_state)
        key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(i))), s.mesh)
        state, metrics = s.mode.train_step(state, _trainer.place(batch, s.mode.batch_sharding),
                                           key, i)  # fmt: skip
        out.append(jax.device_get(metrics))
    return s, out, [np.asarray(p) for p in jax.tree.leaves(state.params)]


PAIR = [("slow", 2), ("fast", 4)]


@pytest.mark.slow
def test_data_parallel_pair_equals_the_flat_axis(make_config):
    _, want, want_params = _run(_dp(make_config, [("data", 8)], IDENTITY))
    s, got, params = _run(_dp(make_config, PAIR, IDENTITY))
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    for a, b in zip(params, want_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "2 slow x 4 fast: dense over fast" in s.mode.description
    # bytes per axis: identity sends every float once over each axis (the host's devices one
    # share each), and the fast axis the owners' means once more (the gather); the flat run has
    # no fast axis
    dense = s.mode.dense_bytes
    assert all(m["wire_bytes"] == dense for m in got)
    assert all(m["fast_wire_bytes"] == dense + _gathered(params) for m in got)
    assert "fast_wire_bytes" not in want[0]


def _gathered(params):
    """Bytes of the sharded mean's gather over the 4 fast devices (each owner's means)."""
    return _reduce_shards.gathered_bytes(params, 4)


@pytest.mark.slow
@pytest.mark.parametrize("reducer", [POWER_SGD, ACCORDION], ids=["power_sgd", "accordion"])
def test_data_parallel_pair_compresses_only_the_slow_axis(make_config, reducer):
    s, got, params = _run(_dp(make_config, PAIR, reducer), steps=2)
    dense = s.mode.dense_bytes
    for m in got:
        assert m["finite"] == 1
        assert m["fast_wire_bytes"] == dense + _gathered(params)  # dense inside a host
        assert 0 < m["wire_bytes"] < dense / 4  # compressed between hosts
    assert all(np.isfinite(p).all() for p in params)
    # the compiled step's collectives: groups of 4 (fast) and 2 (slow), none over all 8 (the
    # loss and accuracy means too: over fast, then slow)
    recs = s.mode.extra["collectives"]
    assert {r["group_size"] for r in recs} == {2, 4}, recs


@pytest.mark.slow
def test_pipeline_pair_equals_the_flat_data_axis(make_config):
    flat = [("data", 4), ("stage", 2)]
    pair = [("slow", 2), ("fast", 2), ("stage", 2)]
    _, want, want_params = _run(_pipe(make_config, flat, IDENTITY))
    s, got, params = _run(_pipe(make_config, pair, IDENTITY))
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    for a, b in zip(params, want_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    dense = s.mode.extra["data_dense_bytes_per_step"]
    assert all(m["data_wire_bytes"] == m["data_fast_wire_bytes"] == dense for m in got)
    assert "data_fast_wire_bytes" not in want[0]

    s, got, _ = _run(_pipe(make_config, pair, POWER_SGD), steps=1)
    assert got[0]["data_fast_wire_bytes"] == dense
    assert 0 < got[0]["data_wire_bytes"] < dense / 4


@pytest.mark.parametrize(
    "mesh, keys, error",
    [
        ([("a", 2), ("b", 2), ("c", 2)], {}, r"one data axis named 'data' or two data axes"),
        ([("slow", 8)], {}, r"one data axis named 'data' or two data axes"),
        (
            PAIR,
            {"data_parallel": {"transform": "accordion_batch_size"}},
            r"'accordion_batch_size' takes one data axis",
        ),
        (
            PAIR,
            {
                "model_name": "resnet18",
                "data": {"flat": False},
                "model": {
                    "width": 8,
                    "blocks": (1, 1),
                    "cuts": (),
                    "input_shape": (8, 8, 1),
                    "norm": "batch",
                },
            },
            r"does not support BatchNorm statistics yet",
        ),
    ],
    ids=["three_axes", "one_axis_not_data", "batch_size_variant", "batch_norm"],
)
def test_what_a_pair_does_not_support_is_named(make_config, mesh, keys, error):
    config = _dp(make_config, mesh, keys.pop("data_parallel", IDENTITY), **keys)
    with pytest.raises(ValueError, match=error):
        train.setup(config)
