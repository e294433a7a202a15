"""Upstream case (JAX, not jaxcomp): the TPU lowering of an SVD on a varying value.

With jax 0.10.2, ``jnp.linalg.svd`` inside ``shard_map`` on a value that varies over a mesh
axis fails to lower for TPU: the TPU SVD (QDWH) starts its loop carry with an unvarying
``True`` and the body returns a varying one, so tracing the loop raises "scan body function
carry input and carry output must have equal types ... bool[] ... bool[]{V:axis}". The raw
case is a strict xfail: when JAX fixes it the test fails, and jaxcomp's workaround
(``jaxcomp.ab._factor.svd``: the SVD in a nested ``shard_map`` with
``check_vma=False``, its results cast back to varying) can go.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh


def _export_for_tpu(body):
    mesh = jax.make_mesh((2,), ("g",), devices=jax.devices()[:2])
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("g"), out_specs=P("g")))
    arg = jax.ShapeDtypeStruct((2, 8, 4), jnp.float32, sharding=NamedSharding(mesh, P("g")))
    with jax.set_mesh(mesh):
        return jax.export.export(fn, platforms=["tpu"])(arg)


@pytest.mark.xfail(strict=True, raises=TypeError, reason="upstream: JAX's TPU SVD on varying")
def test_svd_of_a_varying_value_lowers_for_tpu():
    _export_for_tpu(lambda w: jnp.linalg.svd(w[0], full_matrices=False)[1][None])


def test_workaround_svd_in_a_nested_check_vma_false_shard_map_lowers_for_tpu():
    def body(w):
        local = jax.shard_map(
            lambda v: jnp.linalg.svd(v, full_matrices=False)[1], mesh=get_abstract_mesh(),
            in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False,
        )  # fmt: skip
        return jax.lax.pcast(local(w[0]), "g", to="varying")[None]

    exported = _export_for_tpu(body)
    assert exported.platforms == ("tpu",)
