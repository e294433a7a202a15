"""Pipeline replicas over a (slow, fast) axis pair: a (slow 2 x fast 2 x stage 2) mesh, the
replicas' gradients averaged densely over fast and compressed over slow; == a flat data axis
of 4 replicas where the math says so; the exported program's collectives say which axis
carries what."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp import transforms

SLOW, FAST = "slow", "fast"
PAIR = (SLOW, FAST)
LINK = pipeline.link(F.error_feedback(C.top_k(0.5, per_sample=True)), C.quantize(8))


@pytest.fixture(scope="module")
def setup(tools):
    mlp = tools.make_mlp(microbatch=2, num_stages=2)
    batch = {k: jnp.concatenate([v, v[::-1]] * 2) for k, v in mlp.batch.items()}  # 4 x 8 rows
    mesh = comm.make_mesh([(SLOW, 2), (FAST, 2), (comm.STAGE, 2)])
    return mlp, batch, mesh


def _pipe(mlp, mesh, tx, **kw):
    config = pipeline.PipelineConfig(mlp.M, LINK, schedule="1f1b", replica_mean=tx)
    return pipeline.distribute(mlp.model, config, mesh, **kw)


def _run(pipe, mlp, batch, steps=2):
    states = pipe.init(mlp.params, batch)
    step = jax.jit(pipe.step)
    out = []
    for i in range(steps):
        loss, grads, states, metrics = step(mlp.params, batch, states, jax.random.key(i))
        out.append((float(loss), [np.asarray(x) for x in jax.tree.leaves(grads)], metrics))
    return out


def test_identity_over_the_pair_is_the_plain_mean_of_four_replicas(setup, tools):
    mlp, batch, mesh = setup
    flat = comm.make_mesh([(comm.DATA, 4), (comm.STAGE, 2)])
    want = _run(_pipe(mlp, flat, None), mlp, batch)
    got = _run(_pipe(mlp, mesh, transforms.compressed_mean(C.identity(), PAIR), data_axis=PAIR),
               mlp, batch)  # fmt: skip
    stage_bytes = sum(x.size * 4 for x in jax.tree.leaves(mlp.params))
    for (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) in zip(got, want):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        tools.close(grads, ref_grads, rtol=1e-5, atol=1e-6)
        # per stage device: its stage's gradient densely over fast, then over slow (identity)
        assert float(metrics["data_fast_wire_bytes"]) == stage_bytes
        assert float(metrics["data_wire_bytes"]) == stage_bytes
        assert "data_fast_wire_bytes" not in ref_metrics
    # the plain mean over a pair: the same numbers, a stage's bytes on each axis
    plain = _run(_pipe(mlp, mesh, None, data_axis=PAIR), mlp, batch, steps=1)[0]
    tools.close(plain[1], want[0][1], rtol=1e-5, atol=1e-6)
    assert float(plain[2]["data_fast_wire_bytes"]) == float(plain[2]["data_wire_bytes"])


def _groups(mesh, axis):
    """Device-id groups of a collective over ``axis`` (the mesh's devices in order)."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
    return sorted(moved.reshape(-1, mesh.shape[axis]).tolist())


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: transforms.compressed_mean(F.error_feedback(C.power_sgd(1)), PAIR),
        # slow tier: Accordion's own split over the pair is the fast tier's
        # tests/transforms/test_accordion_pair.py::test_hlo_dense_on_fast_compressed_on_slow
        pytest.param(
            lambda: transforms.accordion(
                C.power_sgd(2), C.power_sgd(1), interval_steps=1, check_every=1, axis_name=PAIR
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["power_sgd_ef", "accordion"],
)
def test_hlo_dense_on_fast_compressed_on_slow(setup, make_tx, load_test_module):
    mlp, batch, mesh = setup
    pipe = _pipe(mlp, mesh, make_tx(), data_axis=PAIR)
    states = pipe.init(mlp.params, batch)
    with jax.set_mesh(mesh):
        exported = jax.export.export(jax.jit(pipe.step), platforms=["cuda", "tpu"])(
            mlp.params, batch, states, jax.random.key(0)
        )
    # test_compressed_mean_pair's _collectives: (kind, operand type, replica groups) of each
    found = load_test_module("transforms/test_compressed_mean_pair.py")._collectives(exported)
    fast = [t for _, t, g in found if sorted(g) == _groups(mesh, FAST)]
    slow = [t for _, t, g in found if sorted(g) == _groups(mesh, SLOW)]
    w = "tensor<16x16xf32>"  # a stage's weight gradient
    assert w in fast, found  # dense over the fast axis
    assert slow and w not in slow, found  # the slow links see factors, not the gradient
    assert any(t in ("tensor<16x1xf32>", "tensor<16x2xf32>") for t in slow), slow
    # with PowerSGD rank 1 the bytes the run reports are the slow collectives' tensors
    _, _, metrics = _run(pipe, mlp, batch, steps=1)[0]
    assert 0 < float(metrics["data_wire_bytes"]) < float(metrics["data_dense_bytes"]) / 2
    assert float(metrics["data_fast_wire_bytes"]) == float(metrics["data_dense_bytes"])


@pytest.mark.parametrize(
    ("data_axis", "match"),
    [
        ((SLOW, SLOW), "pair of distinct names"),
        ((SLOW, comm.STAGE), "pair of distinct names"),
        ((SLOW, FAST, "x"), "pair of distinct names"),
        (comm.DATA, "mesh axes must be 'stage' and optionally 'data'"),
        ((SLOW, "host"), "mesh axes must be 'stage' and optionally 'slow' and 'host'"),
    ],
)
def test_bad_data_axes_are_named(setup, data_axis, match):
    mlp, _, mesh = setup
    with pytest.raises(ValueError, match=match):
        _pipe(mlp, mesh, None, data_axis=data_axis)


def test_a_replica_mean_that_does_not_average_over_the_pair_is_named(setup):
    mlp, batch, mesh = setup
    pipe = _pipe(mlp, mesh, transforms.compressed_mean(C.identity(), SLOW), data_axis=PAIR)
    states = pipe.init(mlp.params, batch)
    with pytest.raises(ValueError, match=r"differ per replica over \['fast'\]"):
        # jitted: the check runs while tracing (called eagerly, the pipeline's forward and
        # backward ran op by op before it: ~100 compiles)
        jax.jit(pipe.step)(mlp.params, batch, states, jax.random.key(0))
