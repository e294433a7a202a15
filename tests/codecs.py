"""The codec table: every codec configuration the codec-level tests loop over, in one place.

A test that takes the argument ``codec_case`` runs once per row (``tests/conftest.py``
parametrizes it, ids the row names): the contract (payload shapes, bytes on a collective,
zeros), the sender's echo at the edges, the exported collectives' dtypes, non-finite inputs
and magnitudes. A new codec, or a new option of one, is a new row here and is then checked
by all of them.

Each row says what its codec documents for the checks that depend on the codec:

* ``nonfinite``: what a NaN or +-Inf entry of the input decodes to:

  - ``same``: the bad entry decodes to itself (NaN stays NaN, +-Inf stays +-Inf), the rest
    finite;
  - ``all``: every entry is non-finite;
  - ``feature``: for +-Inf, every entry of the bad entry's feature column (scale over axis 0)
    is non-finite and every other entry finite; for NaN, every entry is non-finite;
  - ``kept``: the bad entry is kept as itself, every other entry finite;
  - ``kept_all``: every kept entry is non-finite, the dropped ones are zero (the row keeps
    10% of the entries).

* ``bound``: for the codecs that keep every entry, the bound on ``|x_hat - x|`` per entry as a
  function of ``x`` (float64) at any magnitude, before float32 rounding of the decoded value
  (quantizers: one step of the scale that travelled; ``None``: no per-entry bound).

* ``fast``: the row runs in the fast tier (``-m "not slow"``). The fast rows hold every codec,
  every wire format (each bit width that packs differently, the tensor, min-max and feature
  scales, stochastic rounding, per-sample, by-row and blockwise selection, a composition); a
  row that combines options another fast row already has (``fast=False``: a second scale
  dtype, a second block size, the cold start, the unbiased RandK, ...) runs in the slow tier
  only, in every test of the table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import compressors as C


class CodecCase(NamedTuple):
    name: str
    codec: C.Codec
    nonfinite: str
    bound: Callable[[np.ndarray], np.ndarray] | None = None
    fast: bool = True

    def round_trip(self):
        """The row's jitted ``(x, key) -> (payload, state, decoded)`` from a fresh state: one
        function per row, shared by every test module of the process (one compile per shape)."""
        return _round_trip(self.codec)

    def echo(self):
        """The row's error-feedback sender and its receiver, ``(x, state, key, arrived=None) ->
        (compress_and_decode(codec, x, state, key), compress(x, state, key), decompress(arrived,
        x))``, as one jitted program per row shared by every test module of the process (one
        compile per shape; ``arrived=None``: a payload of zeros; the jitted program itself,
        ``(sent, received, arrived)`` with ``(x, state, key)`` twice, is ``echo().program``).

        The three parts read their own copies of the arguments (separate parameters of the
        program), so XLA merges nothing between them (an ``optimization_barrier`` does not keep
        them apart on XLA:CPU: it is expanded before CSE) and each part compiles as it would
        alone; the receiver decodes a payload that arrived as an argument, not one fused with
        a compress. One program holds them because XLA:CPU compiles a fused computation that
        two parts share once (the sender's and the receiver's compress: ~40% of the two
        programs' compile)."""
        return _echo(self.codec)

    def received(self):
        """The row's ``(x, key) -> decompress(compress(x, init(x), key), x)``, what a receiver
        decodes, through :meth:`echo`'s program (two runs of it: the payload, then its decode;
        the program test_contract_echo.py compiles for the row at (16, 64), nothing more)."""
        echo = _echo(self.codec)

        def received(x, key):
            state = self.codec.init(x)
            payload, _ = echo(x, state, key)[1]
            return echo(x, state, key, payload)[2]

        return received

    def exchanged(self, axis_name: str) -> Callable[[jax.Array], jax.Array]:
        """For ``shard_map`` over a 2-device ``axis_name``: compress, swap the payloads with
        the other device (one ``ppermute``), decode."""
        codec = self.codec

        def f(x):
            payload, _ = codec.compress(x, codec.init(x), jax.random.key(0))
            payload = jax.tree.map(lambda a: lax.ppermute(a, axis_name, [(0, 1), (1, 0)]), payload)
            return codec.decompress(payload, x)

        return f


@functools.cache
def _round_trip(codec):
    @jax.jit
    def round_trip(x, key):
        payload, state = codec.compress(x, codec.init(x), key)
        return payload, state, codec.decompress(payload, x)

    return round_trip


@functools.cache
def _echo(codec):
    @jax.jit
    def program(sent, received, arrived):
        x, state, key = received
        return (
            C.compress_and_decode(codec, *sent),
            codec.compress(x, state, key),
            codec.decompress(arrived, x),
        )

    @functools.cache
    def zeros(shape, dtype):  # a payload of zeros for an input of this shape and dtype
        payload = C.payload_shape(codec, jax.ShapeDtypeStruct(shape, dtype))
        return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), payload)

    def echo(x, state, key, arrived=None):
        if arrived is None:
            arrived = zeros(x.shape, x.dtype)
        return program((x, state, key), (x, state, key), arrived)

    echo.program = program
    return echo


def _symmetric(bits: int, feature: bool, wire_eps: float = 0.0):
    """One step ``s / h`` per entry, ``s`` the absmax (per feature column) rounded up by at
    most ``wire_eps`` (a bfloat16 scale: ``2**-7``)."""

    def bound(x):
        amax = np.abs(x).max(0, keepdims=True) if feature else np.abs(x).max()
        return amax * (1 + wire_eps) / 2 ** (bits - 1)

    return bound


def _minmax(bits: int, stochastic: bool):
    """Half a step of the min-max range over ``2**bits - 1`` levels, a full step stochastic."""
    return lambda x: (x.max() - x.min()) / ((1 if stochastic else 2) * (2**bits - 1))


CODEC_TABLE = (
    CodecCase("identity", C.identity(), "same"),
    CodecCase("cast_fp16", C.cast("float16"), "same"),
    CodecCase("cast_bf16", C.cast("bfloat16"), "same", lambda x: np.abs(x) * 2.0**-8),
    CodecCase("quantize1", C.quantize(1), "all", _symmetric(1, False)),
    CodecCase("quantize2_minmax", C.quantize(2, scale="minmax"), "all", _minmax(2, False)),
    CodecCase(
        "quantize3_minmax_stochastic",
        C.quantize(3, scale="minmax", rounding="stochastic"),
        "all",
        _minmax(3, True),
        fast=False,
    ),
    CodecCase(
        "quantize4_stochastic", C.quantize(4, rounding="stochastic"), "all", _symmetric(4, False)
    ),
    CodecCase(
        "quantize4_feature_axis0",
        C.quantize(4, scale="feature", axes=(0,)),
        "feature",
        _symmetric(4, True, 2.0**-7),
    ),
    CodecCase(
        "quantize4_feature_stochastic",
        C.quantize(4, scale="feature", rounding="stochastic"),
        "feature",
        _symmetric(4, True, 2.0**-7),
        fast=False,
    ),
    CodecCase("quantize5", C.quantize(5), "all", _symmetric(5, False)),
    CodecCase("quantize8", C.quantize(8), "all", _symmetric(8, False)),
    CodecCase(
        "quantize8_feature", C.quantize(8, scale="feature"), "feature", _symmetric(8, True, 2.0**-7)
    ),
    CodecCase(
        "quantize8_feature_f32",
        C.quantize(8, scale="feature", scale_dtype=jnp.float32),
        "feature",
        _symmetric(8, True),
    ),
    CodecCase(
        "quantize8_feature_fp16",
        C.quantize(8, scale="feature", scale_dtype=jnp.float16),
        "feature",
        fast=False,
    ),
    CodecCase("sign", C.sign(), "all"),
    CodecCase("sign_rms", C.sign(scale="rms"), "all", fast=False),
    CodecCase("top_k", C.top_k(0.1), "kept"),
    CodecCase("top_k_per_sample", C.top_k(0.25, per_sample=True), "kept"),
    CodecCase("top_k_blockwise", C.top_k(0.1, method="blockwise"), "kept"),
    CodecCase(
        "top_k_blockwise_64",
        C.top_k(0.1, method="blockwise", block_size=64),
        "kept",
        fast=False,
    ),
    CodecCase(
        "top_k_count_blockwise_64",
        C.top_k(count=8, method="blockwise", block_size=64),
        "kept",
        fast=False,
    ),
    CodecCase(
        "top_k_per_sample_blockwise",
        C.top_k(0.25, per_sample=True, method="blockwise"),
        "kept",
        fast=False,
    ),
    CodecCase("top_k_rows", C.top_k(0.1, row_axis=-1), "kept"),
    CodecCase(
        "top_k_rows_axis0_blockwise",
        C.top_k(0.25, row_axis=0, method="blockwise", block_size=4),
        "kept",
        fast=False,
    ),
    CodecCase("rand_k", C.rand_k(0.1), "kept_all"),
    CodecCase("rand_k_unbiased", C.rand_k(0.1, unbiased=True), "kept_all", fast=False),
    CodecCase("power_sgd", C.power_sgd(2), "all"),
    CodecCase("power_sgd_cold", C.power_sgd(2, warm_start=False), "all", fast=False),
    CodecCase("top_k+quantize8", C.compose(C.top_k(0.1), C.quantize(8)), "kept_all"),
    CodecCase(
        "rand_k+quantize4_stochastic",
        C.compose(C.rand_k(0.1), C.quantize(4, rounding="stochastic")),
        "kept_all",
        fast=False,
    ),
)
