"""_bits.move_as_bits: 8- and 16-bit floats cross data-moving collectives as their bit
patterns (XLA:CPU widens them: twice the bytes, NaN payloads canonicalised); to_bytes /
from_bytes: a pytree as one byte vector and back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp._bits import _carrier
from jaxcomp._bits import byte_size
from jaxcomp._bits import from_bytes
from jaxcomp._bits import move_as_bits
from jaxcomp._bits import to_bytes

# a signalling-style NaN payload (0x7f81), -0.0, infinities, a subnormal, a tie of magnitudes
BF16_BITS = np.array([0x7F81, 0xFFC1, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x3F80, 0xBF80], np.uint16)


def _mesh(n=2):
    return comm.make_mesh([(comm.DATA, n)], devices=jax.devices()[:n])


def _gather_and_permute(x):
    def body(v):
        gathered = move_as_bits(lambda t: lax.all_gather(t, comm.DATA, to="invarying"), v)
        swapped = move_as_bits(lambda t: lax.ppermute(t, comm.DATA, [(0, 1), (1, 0)]), v)
        return gathered, swapped

    return jax.jit(
        jax.shard_map(body, mesh=_mesh(), in_specs=P(comm.DATA), out_specs=(P(), P(comm.DATA)))
    )


@pytest.mark.user_numerics
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_what_arrives_is_what_was_sent_bit_for_bit_and_the_wire_carries_its_width(dtype):
    width = np.dtype(dtype).itemsize
    raw = BF16_BITS if width == 2 else (BF16_BITS & 0xFF).astype(np.uint8)
    x = jnp.asarray(raw.view(dtype))  # 8 values: 4 per worker
    fn = _gather_and_permute(x)
    gathered, swapped = fn(x)
    assert gathered.dtype == dtype and swapped.dtype == dtype
    assert np.asarray(gathered).tobytes() == raw.tobytes()
    assert np.asarray(swapped).tobytes() == np.concatenate([raw[4:], raw[:4]]).tobytes()
    report = comm.measure_collectives(fn, x)
    assert report.bytes_by_kind() == {"all-gather": 4.0 * width, "collective-permute": 4.0 * width}


def test_the_carriers():
    assert _carrier(jnp.bfloat16) == jnp.uint16 and _carrier(jnp.float8_e5m2) == jnp.uint8
    for dtype in (jnp.float32, jnp.int8, jnp.uint16, jnp.int4, jnp.float4_e2m1fn, bool):
        assert _carrier(dtype) is None, dtype  # sent as they are (sub-byte: no bit view)


def test_a_tree_without_narrow_floats_is_moved_as_it_is_and_mixed_trees_keep_their_dtypes():
    tree = {"a": jnp.ones(3), "i": jnp.arange(3)}
    assert move_as_bits(lambda t: t, tree) is tree
    mixed = {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2), "i": jnp.arange(2, dtype=jnp.int8)}
    seen = []
    out = move_as_bits(lambda t: seen.append(jax.tree.map(lambda v: v.dtype, t)) or t, mixed)
    assert seen == [{"a": jnp.uint16, "b": jnp.float32, "i": jnp.int8}]
    assert jax.tree.map(lambda v: v.dtype, out) == jax.tree.map(lambda v: v.dtype, mixed)


def test_a_bf16_top_k_reduction_sends_the_bytes_its_protocol_counts():
    """The all-gather path of a bfloat16 TopK payload: the compiled HLO's bytes equal the
    protocol's wire bytes (before, XLA:CPU sent the 16-bit values as float32)."""
    codec = compressors.top_k(0.25)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(64), jnp.bfloat16)

    def body(v):
        protocol = comm.plan_reduce(codec, v, path="all_gather", min_ndim=1)
        mean, _, _ = comm.compressed_pmean(v, protocol, protocol.init(v, 2), None, comm.DATA)
        return mean, jnp.float32(protocol.wire_bytes(v, 2))

    fn = jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=P(), out_specs=(P(), P())))
    report = comm.measure_collectives(fn, x)
    assert report.total_bytes == float(fn(x)[1]) == 16 * (2 + 1)  # bf16 value + u8 index


@pytest.mark.user_numerics
def test_to_bytes_and_back_is_bit_for_bit_padded_and_refuses_what_has_no_byte_view():
    """A pytree of mixed dtypes (a NaN payload, -0.0, bools, bfloat16, int8) becomes one
    uint8 vector of its bytes, zero-padded, and comes back bit for bit, under jit too; a
    sub-byte leaf or a size below the bytes is refused, and a vector too short to hold the
    tree is refused (not read past its end)."""
    tree = {
        "f": jnp.asarray(
            np.array([0x7FC00001, 0x80000000, 0x3F800000], np.uint32).view(np.float32)
        ),
        "h": jnp.asarray(BF16_BITS[:3].view(jnp.bfloat16)),
        "m": jnp.asarray([True, False]),
        "i": jnp.asarray([-128, 127], jnp.int8),
    }
    assert byte_size(tree) == 12 + 6 + 2 + 2
    v = to_bytes(tree, 25)
    assert v.dtype == jnp.uint8 and v.shape == (25,) and not np.asarray(v[22:]).any()
    for back in (from_bytes(v, tree), jax.jit(lambda u: from_bytes(u, tree))(v)):
        for k in tree:
            assert back[k].dtype == tree[k].dtype and back[k].shape == tree[k].shape
            assert np.asarray(back[k]).tobytes() == np.asarray(tree[k]).tobytes(), k
    assert to_bytes(tree).shape == (22,)
    with pytest.raises(ValueError, match="below the tree's 22 bytes"):
        to_bytes(tree, 21)
    with pytest.raises(ValueError, match="the tree needs 22"):
        from_bytes(v[:21], tree)
    for dtype in (jnp.int4, jnp.float4_e2m1fn):
        with pytest.raises(TypeError, match="sub-byte"):
            to_bytes({"x": jnp.zeros(4, dtype)})
