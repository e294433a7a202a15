"""Compress-and-decode equals decompress of compress, for every row of the codec table
(``tests/codecs.py``) at the edges (NaN, +-Inf, magnitudes 1e-10 and 1e6), bit for bit.

At XLA's default compile: the fused sender and the separately compiled receiver are two
differently optimised programs, whose agreement on non-finite entries is what this guards
(``test_contract.py`` runs unoptimised)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.user_numerics

SHAPE = (16, 64)


EDGES = {
    "normal": lambda x: x,
    "nan": lambda x: x.at[3, 5].set(jnp.nan),
    "inf": lambda x: x.at[3, 5].set(jnp.inf),
    "-inf": lambda x: x.at[7, 1].set(-jnp.inf),
    "tiny": lambda x: x * 1e-10,
    "huge": lambda x: x * 1e6,
}


@pytest.mark.slow  # three programs per row at the default compile (test_contract.py: fast)
@pytest.mark.parametrize("edge", EDGES)
def test_compress_and_decode_equals_decompress_of_compress(codec_case, edge):
    """The error-feedback sender's echo is what the receiver decodes, at the edges too (a
    quantize round trip once decoded a NaN entry as NaN while the payload decoded it as -inf)."""
    codec = codec_case.codec
    x = EDGES[edge](jax.random.normal(jax.random.key(2), SHAPE))
    state = codec.init(x)
    key = jax.random.key(3)
    payload, new_state, x_hat = codec_case.compress_and_decode()(x, state, key)
    (ref_payload, ref_state), received = _receiver(codec)(x, state, key, payload)
    jax.tree.map(np.testing.assert_array_equal, payload, ref_payload)
    jax.tree.map(np.testing.assert_array_equal, new_state, ref_state)
    np.testing.assert_array_equal(x_hat, received)


@functools.cache
def _receiver(codec):
    """As in practice, compress alone on one side and decompress on the other: one program per
    row (a compile each costs more than the runs) holding ``compress(x, state, key)`` and the
    decode of the payload that arrived, an argument of the program (no compress precedes it,
    as on a receiving device: the same payload's bits as compress's, asserted)."""
    return jax.jit(lambda x, s, k, arrived: (codec.compress(x, s, k), codec.decompress(arrived, x)))
