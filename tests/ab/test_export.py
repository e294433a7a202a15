"""Every AB-Training program lowers for GPU and TPU (``jax.export``, no hardware needed).

The harness's three programs (dense step, AB step with its sync, re-factorisation) on a
rectangular and a flat (unequal groups) layout, and the optax transform's single
``lax.switch`` program, for ``["cuda"]`` and ``["tpu"]``; the factor gradients travel as
float32 collectives of the factors' shapes. The SVDs of the re-factorisation need the workaround of
``tests/upstream/test_tpu_svd_varying.py`` on TPU.
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _programs

PARAMS = {
    "l1": {"kernel": jax.ShapeDtypeStruct((6, 5), jnp.float32)},
    "l2": {"kernel": jax.ShapeDtypeStruct((5, 8), jnp.float32),
           "bias": jax.ShapeDtypeStruct((8,), jnp.float32)},
}  # fmt: skip


def loss_fn(p, x):
    h = jnp.tanh(x @ p["l1"]["kernel"])
    return jnp.mean((h @ p["l2"]["kernel"] + p["l2"]["bias"]) ** 2)


LAYOUTS = {
    "rectangular": (lambda: parallel.ab_mesh(2, jax.devices()[:4]), {}),
    "flat": (lambda: comm.make_mesh([("data", 5)], jax.devices()[:5]),
             dict(axis_name="data", group_size=2)),
}  # fmt: skip


def _config(options):
    return transforms.ABConfig(1e-2, warmup_steps=2, sync_every=4, full_rank_steps=1,
                               max_rank=3, **options)  # fmt: skip


def _export(fn, args, mesh, platform):
    with jax.set_mesh(mesh):
        return jax.export.export(fn, platforms=[platform])(*args).mlir_module()


@functools.cache
def _harness(layout):
    """A layout's mesh, config, programs and abstract arguments: built once, so that the
    second platform's export reuses the jitted functions' traces (only lowering differs)."""
    make_mesh, options = LAYOUTS[layout]
    mesh = make_mesh()
    config = _config(options)
    programs = _programs.Programs(config, loss_fn, mesh)
    state = _programs.abstract_train_state(config, PARAMS, mesh)
    batch = jax.ShapeDtypeStruct((2 * mesh.size, 6), jnp.float32,
                                 sharding=NamedSharding(mesh, P(config.axis_name)))  # fmt: skip
    flag = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, P()))
    args = {"dense": (state, batch), "ab": (state, batch, flag)}
    return mesh, {n: (programs._sharded(n), args.get(n, (state, flag))) for n in _programs.PROGRAMS}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_harness_program_exports(layout, platform):
    mesh, programs = _harness(layout)
    texts = {n: _export(fn, args, mesh, platform) for n, (fn, args) in programs.items()}
    # the AB step's factor gradients travel as float32 of the factors' shapes, within the
    # group: A-gradients (6, 3) and (8, 3) (l2's tall view is 8 x 5), B-gradients (3, 5)
    factor_types = {"6x3xf32", "8x3xf32", "3x5xf32"}
    groups = "[[0, 1], [2, 3]]" if layout == "rectangular" else None
    found = _collective_types(texts["ab"], groups)
    assert factor_types <= found and "8xf32" in found  # and l2's bias
    assert all(t.endswith("f32") for t in found)
    if platform == "tpu":  # the re-factorisation's SVD lowered through the workaround
        assert "stablehlo.while" in texts["refactor"]


def _collective_types(text, replica_groups):
    """Operand types of the module's all-reduces (within ``replica_groups``) and permutes."""
    lines, types = text.splitlines(), set()
    for i, line in enumerate(lines):
        if "stablehlo.collective_permute" in line or (
            "stablehlo.all_reduce" in line and replica_groups and replica_groups in line
        ):
            for follow in lines[i : i + 12]:
                m = re.search(r": \(tensor<([^>]*)>\)", follow)
                if m:
                    types.add(m.group(1))
                    break
    return types


@functools.cache
def _transform_step():
    """The optax transform's jitted step and abstract arguments (one trace, both platforms)."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    config = _config({})
    tx = transforms.ab_transform(config)
    axes = config.axis_name
    spec = P(axes)

    def body(grads, state, params):
        grads, state, params = jax.tree.map(lambda x: x[0], (grads, state, params))
        return jax.tree.map(lambda x: x[None], tx.update(grads, state, params))

    n = mesh.size
    sharding = NamedSharding(mesh, spec)
    lead = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding), t
    )
    state = jax.eval_shape(tx.init, PARAMS)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
    return fn, (lead(PARAMS), lead(state), lead(PARAMS)), mesh


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_optax_transform_exports(platform):
    fn, args, mesh = _transform_step()
    text = _export(fn, args, mesh, platform)
    assert "stablehlo.case" in text  # the lax.switch over the four step kinds
