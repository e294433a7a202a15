"""TopK by rows (``top_k(..., row_axis=-1)``) on pipeline links: in ``"shared_mask"`` mode the
distributed step equals the unpipelined model with every boundary's rows masked (the forward's
kept positions, the same for the gradient), and the backward sends the kept values only; with
EF21 and AQ-SGD the distributed step equals the simulation. The activations are
``[microbatch, tokens, features]``, the layout the rows are for (issue 35)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp.pipeline import _links

TOKENS, K = 3, 2  # K of every token's 16 features


@pytest.fixture(scope="module")
def tokens(mlp3):
    """The 3-stage MLP's stages on ``[6, TOKENS, 16]`` (x @ w acts on the last axis)."""
    mlp = mlp3
    rng = np.random.default_rng(3)
    n, width = mlp.batch["x"].shape
    batch = {
        "x": jnp.asarray(rng.normal(size=(n, TOKENS, width)), jnp.float32),
        "label": jnp.asarray(rng.normal(size=(n, TOKENS, width)), jnp.float32),
        "ids": mlp.batch["ids"],
    }
    return mlp, batch


def _rows_masked(h):
    """``h`` with all but each row's K largest magnitudes zeroed; the mask is a constant to
    the gradient (what ``"shared_mask"`` sends back: ``g`` at the forward's kept positions)."""
    kth = jax.lax.top_k(jnp.abs(h), K)[0][..., -1:]
    return h * jax.lax.stop_gradient(jnp.abs(h) >= kth)


def _masked_loss(params, x, labels):
    h = x
    for b, p in enumerate(params):
        h = jnp.tanh(h @ p["w"] + p["b"])  # the conftest MLP's stage
        if b < len(params) - 1:
            h = _rows_masked(h)
    return jnp.mean((h - labels) ** 2)


_masked_reference = jax.jit(jax.value_and_grad(_masked_loss))


def test_shared_mask_by_rows_equals_the_row_masked_model_and_sends_values_only(
    tokens, stage_mesh3, pack, tools
):
    mlp, batch = tokens
    stage_mesh = stage_mesh3
    link = pipeline.link(C.top_k(count=K, row_axis=-1), mode="shared_mask")
    config = pipeline.PipelineConfig(mlp.M, link)
    pipe = pipeline.distribute(mlp.model, config, stage_mesh)
    packed = pack(mlp.params, stage_mesh)
    states = pipe.init(packed, batch)
    step = jax.jit(pipe.step, static_argnames="compress")
    compiled = step.lower(packed, batch, states, jax.random.key(0), True).compile()
    loss, grads, _, metrics = compiled(packed, batch, states, jax.random.key(0))
    ref_loss, ref_grads = _masked_reference(mlp.params, batch["x"], batch["label"])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(grads.unpack(), ref_grads)
    # the premise: the mask changes the gradient (a dense backward would not match)
    dense_loss, dense_grads = tools.reference(mlp.model, mlp.params, batch)
    assert abs(float(dense_loss) - float(loss)) > 1e-3
    assert np.abs(np.asarray(dense_grads[0]["w"]) - np.asarray(grads.unpack()[0]["w"])).max() > 1e-3
    # on the wire: forward K values + K uint8 indices per row, backward the K values only
    rows = 2 * len(batch["ids"]) * TOKENS  # 2 boundaries
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    assert sent["forward"] == rows * K * 5
    assert sent["backward"] == rows * K * 4
    assert metrics["wire_bytes"] == rows * K * 9


#: one link per boundary (both feedbacks' runs in one program): EF21 from the first stage to
#: the middle one, AQ-SGD (and per-sample EF backward) from the middle stage to the last
LINKS = {
    "ef21+aq_sgd": (
        pipeline.link(F.ef21(C.top_k(count=K, row_axis=-1)), F.ef21(C.top_k(count=K, row_axis=-1))),
        pipeline.link(
            F.aq_sgd(C.top_k(count=K, row_axis=-1), 8),
            F.error_feedback(C.top_k(count=K, row_axis=-1), num_samples=8),
        ),
    ),
}
# AQ-SGD's first step is its uncompressed warm-up, which fills both per-sample caches
SCHEDULES = {"ef21+aq_sgd": (False, True, True)}


@functools.cache
def _steps(name, mlp_model, M, stage_mesh):
    config = pipeline.PipelineConfig(M, LINKS[name])
    pipe = pipeline.distribute(mlp_model, config, stage_mesh)
    sim = pipeline.simulate(mlp_model, config)
    return (
        pipe,
        sim,
        jax.jit(pipe.step, static_argnames="compress"),
        jax.jit(sim.step, static_argnames="compress"),
    )


@pytest.mark.slow  # the compressed step's distributed program and simulation per link
@pytest.mark.parametrize("name", sorted(LINKS))
def test_feedback_by_rows_distributed_equals_simulated(name, tokens, stage_mesh3, pack, tools):
    mlp, batch = tokens
    pipe, sim, step, sim_step = _steps(name, mlp.model, mlp.M, stage_mesh3)
    packed = pack(mlp.params, stage_mesh3)
    states, sim_states = pipe.init(packed, batch), sim.init(mlp.params, batch)
    tools.close(states, sim_states, rtol=0, atol=0)
    for i, compress in enumerate(SCHEDULES[name]):
        key = jax.random.key(i)
        s_loss, s_grads, s_states, s_metrics = sim_step(
            mlp.params, batch, sim_states, key, compress=compress
        )
        if not compress:
            # AQ-SGD's dense warm-up uses no codec: the distributed run starts from the
            # simulation's states after it (a distributed warm-up == the simulation's:
            # test_compressed.py's aq_sgd run); EF21's estimates after the dense step are taken
            # from the simulation too, not compared (their initial states are, above)
            pairs = zip(jax.tree.leaves(s_states), jax.tree.leaves(states), strict=True)
            leaves = [jax.device_put(s, d.sharding) for s, d in pairs]
            states, sim_states = jax.tree.unflatten(jax.tree.structure(states), leaves), s_states
            continue
        loss, grads, new_states, metrics = step(packed, batch, states, key, compress)
        np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
        tools.close(grads.unpack(), s_grads)
        tools.close(new_states, s_states)
        assert metrics["wire_bytes"] == s_metrics["wire_bytes"]
        assert jax.tree.leaves(new_states)  # the feedback states are there and move
        assert (
            max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(new_states), jax.tree.leaves(states))
            )
            > 0
        )
        states, sim_states = new_states, s_states
    # the compressed step: K values + K uint8 indices per token row in each direction
    rows = 2 * len(batch["ids"]) * TOKENS  # 2 boundaries
    assert metrics["wire_bytes"] == 2 * rows * K * 5
