"""The summary's per-kind collective records, read from compiled HLO (train/_collectives.py)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.train import _collectives


@pytest.fixture(scope="module")
def branched_text():
    """A psum every call runs, an all-gather only one branch of a cond runs, in a 3-trip loop."""
    mesh = jax.make_mesh((8,), ("d",))

    def body(x, flag):
        total = lax.psum(x, "d")  # 4 x 16 f32 = 256 B

        def gather(v):
            return lax.all_gather(v[:2], "d", tiled=True, to="invarying").sum(0)  # 2x16 f32

        def skip(v):
            return jnp.zeros(v.shape[1:], v.dtype)

        def step(i, acc):  # the operand changes per trip: XLA cannot hoist the cond
            return acc + lax.cond(flag[0] > 0, gather, skip, x + i.astype(x.dtype))

        return total, lax.fori_loop(0, 3, step, jnp.zeros(x.shape[1:], x.dtype))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P())))
    x = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    flag = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(mesh, P()))
    return f.lower(x, flag).compile().as_text()


def test_records_mark_the_collectives_inside_branches(branched_text):
    recs = _collectives.records(branched_text)
    by_kind = {r["kind"]: r for r in recs}
    assert set(by_kind) == {"all-reduce", "all-gather"}
    reduce, gather = by_kind["all-reduce"], by_kind["all-gather"]
    assert (reduce["bytes_per_execution"], reduce["executions"]) == (256.0, 1.0)
    assert not reduce["conditional"] and reduce["group_size"] == 8
    # one device's 2 x 16 floats, once per loop trip, only when the branch is taken
    assert (gather["bytes_per_execution"], gather["executions"]) == (128.0, 3.0)
    assert gather["conditional"]


def test_weights_merge_and_the_one_line_description(branched_text):
    half = _collectives.records(branched_text, weight=0.5)
    both = _collectives.merge(half, half)
    assert both == _collectives.records(branched_text)
    assert _collectives.merge(_collectives.records(branched_text, weight=0.0)) == []
    text = _collectives.describe(both)
    assert text == "all-gather/8* 384 B, all-reduce/8 256 B"
    assert _collectives.describe([]) == "none"
