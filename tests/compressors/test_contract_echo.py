"""Compress-and-decode equals decompress of compress, for every codec of ``test_contract.py``
at the edges (NaN, +-Inf, magnitudes 1e-10 and 1e6), bit for bit.

At XLA's default compile: the fused sender and the separately compiled receiver are two
differently optimised programs, whose agreement on non-finite entries is what this guards
(``test_contract.py`` runs unoptimised)."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors

_spec = importlib.util.spec_from_file_location(  # test modules cannot import each other
    "_contract_codecs", pathlib.Path(__file__).with_name("test_contract.py")
)
_contract = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_contract)


EDGES = {
    "normal": lambda x: x,
    "nan": lambda x: x.at[3, 5].set(jnp.nan),
    "inf": lambda x: x.at[3, 5].set(jnp.inf),
    "-inf": lambda x: x.at[7, 1].set(-jnp.inf),
    "tiny": lambda x: x * 1e-10,
    "huge": lambda x: x * 1e6,
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("codec", _contract.CODECS, ids=lambda c: c.name)
def test_compress_and_decode_equals_decompress_of_compress(codec, edge):
    """The error-feedback sender's echo is what the receiver decodes, at the edges too (a
    quantize round trip once decoded a NaN entry as NaN while the payload decoded it as -inf)."""
    x = EDGES[edge](jax.random.normal(jax.random.key(2), _contract.SHAPE))
    state = codec.init(x)
    key = jax.random.key(3)
    payload, new_state, x_hat = jax.jit(
        lambda x, s, k: compressors.compress_and_decode(codec, x, s, k)
    )(x, state, key)
    # as in practice: compress on one side, decompress (separately compiled) on the other
    ref_payload, ref_state = jax.jit(codec.compress)(x, state, key)
    jax.tree.map(np.testing.assert_array_equal, payload, ref_payload)
    jax.tree.map(np.testing.assert_array_equal, new_state, ref_state)
    np.testing.assert_array_equal(x_hat, jax.jit(codec.decompress)(ref_payload, x))
