"""Packed per-stage parameters: round trip, mixed dtypes, optax on the packed form."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomp import pipeline


def _stages():
    return [
        {"conv": {"kernel": jnp.arange(24.0).reshape(2, 3, 4)}, "scale": jnp.ones(4, jnp.bfloat16)},
        {"w": jnp.full((5, 2), 2.0), "count": jnp.arange(3, dtype=jnp.int32)},
        {"b": -jnp.ones(7)},
    ]


def test_pack_unpack_round_trip_with_mixed_dtypes_and_structures():
    stages = _stages()
    packed = pipeline.pack_params(stages)
    assert {n: b.shape for n, b in packed.buffers.items()} == {
        "bfloat16": (3, 4),
        "float32": (3, 24),
        "int32": (3, 3),
    }
    back = packed.unpack()
    assert jax.tree.structure(back) == jax.tree.structure(tuple(stages))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(stages)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # padding beyond each stage's own parameters is zero
    assert not np.any(np.asarray(packed.buffers["float32"])[1, 10:])
    assert not np.any(np.asarray(packed.buffers["float32"])[2, 7:])


def test_packed_params_are_a_pytree_for_jit_and_optax():
    stages = [s for s in _stages()]
    stages = jax.tree.map(lambda a: a.astype(jnp.float32), stages)
    packed = pipeline.pack_params(stages)
    grads = jax.tree.map(lambda a: 0.5 * jnp.ones_like(a), stages)
    opt = optax.adam(0.1)

    @jax.jit
    def update(params, grads):
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    via_packed = update(packed, pipeline.pack_params(grads)).unpack()
    via_leaves = update(stages, grads)
    for a, b in zip(jax.tree.leaves(via_packed), jax.tree.leaves(via_leaves)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert optax.tree.norm(pipeline.pack_params(grads)) == pytest.approx(
        float(optax.tree.norm(grads)), rel=1e-6
    )


def test_layout_packs_masks_into_the_parameter_dtypes():
    stages = jax.tree.map(lambda a: a.astype(jnp.float32), _stages())
    layout = pipeline.param_layout(stages)
    mask = jax.tree.map(lambda a: a.ndim > 1, stages)  # e.g. weight decay on matrices only
    packed_mask = layout.pack(mask)
    assert set(packed_mask) == {"float32"}
    assert float(packed_mask["float32"].sum()) == 24 + 10


def test_structure_mismatch_is_reported():
    layout = pipeline.param_layout(_stages())
    with pytest.raises(ValueError, match="stage 1's pytree structure differs"):
        layout.pack([_stages()[0], {"w": jnp.ones((5, 2))}, _stages()[2]])
    with pytest.raises(ValueError, match="expected 3 per-stage pytrees"):
        layout.pack(_stages()[:2])


def test_gradient_of_a_stage_unpack_is_one_concatenate():
    """The gradient through unpack_stage writes each leaf's cotangent once: no zero-padded
    full-length vector per leaf (which made a many-leaf stage's backward O(leaves x length))."""
    stages = jax.tree.map(lambda a: a.astype(jnp.float32), _stages())
    layout = pipeline.param_layout(stages)
    local = {g: b[0] for g, b in layout.pack(stages).items()}

    def total(local):
        tree = layout.unpack_stage(0, local)
        return sum(jnp.sum(leaf * (i + 1)) for i, leaf in enumerate(jax.tree.leaves(tree)))

    grad = jax.grad(total)
    text = jax.jit(grad).lower(local).as_text()
    assert "stablehlo.pad" not in text and "dynamic_update_slice" not in text
    expected = layout.pack([jax.tree.map(jnp.ones_like, s) for s in stages])["float32"][0]
    expected = expected.at[24:28].multiply(2.0)  # leaves: kernel (24 values), scale (4)
    np.testing.assert_array_equal(grad(local)["float32"], expected)
