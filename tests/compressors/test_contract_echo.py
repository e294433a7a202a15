"""Compress-and-decode equals decompress of compress, for every row of the codec table
(``tests/codecs.py``) at the edges (NaN, +-Inf, magnitudes 1e-10 and 1e6), bit for bit.

At XLA's default compile: the fused sender and the receiver (a compress, and the decode of a
payload that arrived) are differently optimised, whose agreement on non-finite entries is what
this guards (``test_contract.py`` runs unoptimised). They are parts of one program per row on
separate parameters (``tests/codecs.py``: ``echo``; compiled apart they cost ~40% more)."""

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


@pytest.mark.slow  # a program per row at the default compile (test_contract.py: fast)
@pytest.mark.parametrize("edge", EDGES)
def test_compress_and_decode_equals_decompress_of_compress(codec_case, edge):
    """The error-feedback sender's echo is what the receiver decodes, at the edges too (a
    quantize round trip once decoded a NaN entry as NaN while the payload decoded it as -inf).

    As in practice, compress alone on one side and decompress on the other: the receiver's
    parts of the row's program (``tests/codecs.py``: ``echo``) compress on their own copy of
    the arguments, and decode the sender's payload as an argument of the program (no compress
    precedes it, as on a receiving device)."""
    codec = codec_case.codec
    x = EDGES[edge](jax.random.normal(jax.random.key(2), SHAPE))
    state = codec.init(x)
    key = jax.random.key(3)
    echo = codec_case.echo()
    (payload, new_state, x_hat), (ref_payload, ref_state), _ = echo(x, state, key)
    received = echo(x, state, key, payload)[2]
    jax.tree.map(np.testing.assert_array_equal, payload, ref_payload)
    jax.tree.map(np.testing.assert_array_equal, new_state, ref_state)
    np.testing.assert_array_equal(x_hat, received)


@pytest.mark.slow
def test_the_sender_and_the_receiver_are_apart_in_their_program(codec_table):
    """The row's program keeps the receiver's compress apart from the sender's: both read an
    input parameter of their own (were they one parameter, XLA would merge the two compresses
    and the test above would compare a compress with itself)."""
    case = next(case for case in codec_table if case.name == "quantize1")
    x = jnp.zeros(SHAPE, jnp.float32)
    args = (x, case.codec.init(x), jax.random.key(3))
    arrived = jax.eval_shape(case.codec.compress, *args)[0]
    # the program the row's tests above compiled: a cache hit after them
    compiled = case.echo().program.lower(args, args, arrived).compile().as_text()
    entry = compiled[compiled.index("ENTRY") :]
    assert entry.count("f32[16,64]{1,0} parameter(") == 2, entry
