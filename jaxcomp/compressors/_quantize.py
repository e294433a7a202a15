"""Uniform quantization to 1-8 bits, bit-packed into ``uint8``.

Three scale modes, as in the papers:

* ``"tensor"``: symmetric, one absmax scale per tensor.
* ``"feature"``: symmetric, one absmax scale per feature position, the max taken over ``axes``
  (default ``(0,)``, the batch axis) and sent as ``float16`` — AC-SGD's
  ``_compress_nbits(scale_method='max', scale_dims=(0,))`` used by Rudakov et al.
* ``"minmax"``: affine with one global ``(min, max)`` pair — Rudakov et al.'s
  ``quantize_custom`` ("quantization_simple").

Symmetric modes follow AC-SGD exactly (``h = 2**(bits-1)``, ``s`` the scale)::

  q = clip(round(x / (s + 1e-6) * h), -h, h - 1);    x_hat = q / h * s

so the error is at most ``s / (2h)`` inside the range and ``s / h`` at the clipped top level.
The min-max mode uses ``L = 2**bits - 1`` levels::

  q = round((x - lo) / (hi - lo) * L);               x_hat = q / L * (hi - lo) + lo

with error at most ``(hi - lo) / (2L)``. A constant tensor (``hi == lo``) decodes exactly.
Stochastic rounding replaces ``round(v)`` by ``floor(v + u)``, ``u ~ U[0, 1)``, which is unbiased
inside the range; the error is then below one step.

Non-finite inputs are never made finite: a NaN or Inf in a scale group makes that group's scale
non-finite, and the whole group decodes to NaN (or +-Inf).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.compressors import _base
from jaxcomp.compressors import _bitpack
from jaxcomp.compressors import _noise

SCALE_MODES = ("tensor", "feature", "minmax")
ROUNDING_MODES = ("nearest", "stochastic")
_EPS = 1e-6  # AC-SGD's guard in the divisor; keeps all-zero groups exactly zero


class QuantizedPayload(NamedTuple):
    """Bit-packed codes and the scales needed to decode them.

    Attributes:
      codes: ``uint8[packed_size(n, bits)]``, the packed unsigned codes.
      scale: ``float32[]`` (tensor), ``float16[feature shape]`` (feature) or ``float32[2]``
        holding ``(lo, hi)`` (minmax).
    """

    codes: jax.Array
    scale: jax.Array


def _rounded(v: jax.Array, key: jax.Array | None, stochastic: bool) -> jax.Array:
    if stochastic:
        return jnp.floor(v + _noise.uniform_noise(key, v.shape))
    return jnp.round(v)


def quantize(
    bits: int = 8,
    *,
    scale: str = "tensor",
    axes: tuple[int, ...] = (0,),
    rounding: str = "nearest",
    scale_dtype=None,
) -> _base.Codec:
    r"""Uniform ``bits``-bit quantization with bit-packed codes.

    .. math::
      \hat x = \frac{\mathrm{clip}(\lfloor x h / (s + 10^{-6}) \rceil, -h, h - 1)}{h} s,
      \quad h = 2^{b-1}

    Args:
      bits: code width, 1..8.
      scale: ``"tensor"``, ``"feature"`` or ``"minmax"`` (see the module docstring).
      axes: for ``scale="feature"``, the axes the absmax is taken over (the rest index the
        scales). AC-SGD uses ``(0,)`` for CNN activations and ``(0, 1)`` for (batch, seq, emb).
      rounding: ``"nearest"`` (deterministic, the papers' default) or ``"stochastic"``
        (unbiased, needs a key; uses a fused integer-hash noise, not ``jax.random.uniform``).
      scale_dtype: dtype the scales travel in; default ``float16`` for ``"feature"`` (AC-SGD)
        and ``float32`` otherwise.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`QuantizedPayload` payloads of
      ``ceil(n * bits / 8)`` code bytes plus the scales.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.quantize(4)
      >>> x = jnp.array([1.0, -0.5, 0.25, 0.0])
      >>> payload, _ = codec.compress(x, codec.init(x), None)
      >>> payload.codes.dtype, payload.codes.shape
      (dtype('uint8'), (2,))

    References:
      Wang et al., `Fine-tuning Language Models over Slow Networks using Activation Compression
      with Guarantees <https://arxiv.org/abs/2206.01299>`_, 2022 (AC-SGD ``fixpoint``).
      Rudakov et al., `Activations and Gradients Compression for Model-Parallel Training
      <https://arxiv.org/abs/2401.07788>`_, 2024.
    """
    _base.check_int_range("bits", bits, 1, 8)
    _base.check_choice("scale", scale, SCALE_MODES)
    _base.check_choice("rounding", rounding, ROUNDING_MODES)
    if scale == "feature":
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, int) for a in axes):
            raise ValueError(f"axes must be a tuple of ints; got {axes!r}.")
        axes = tuple(axes)
    if scale_dtype is None:
        scale_dtype = jnp.float16 if scale == "feature" else jnp.float32
    scale_dtype = np.dtype(scale_dtype)
    if not jnp.issubdtype(scale_dtype, jnp.floating):
        raise ValueError(f"scale_dtype must be a floating dtype; got {scale_dtype}.")
    stochastic = rounding == "stochastic"
    name = f"quantize({bits}, {scale}{', stochastic' if stochastic else ''})"
    half = float(2 ** (bits - 1))
    levels = float(2**bits - 1)

    def feature_axes(ndim: int) -> tuple[int, ...]:
        norm = tuple(sorted({a % ndim for a in axes})) if ndim else ()
        if any(a >= ndim or a < -ndim for a in axes):
            raise ValueError(f"axes {axes} out of range for a {ndim}-D input.")
        return norm

    def init(x):
        _base.check_float(x, name)
        return _base.EmptyState()

    def codes_and_scale(x, key):
        """Unsigned codes (float-valued) and the scale that travels."""
        _base.check_float(x, name)
        if stochastic:
            _base.check_key(key, name)
        xf = x.astype(jnp.float32)
        if scale == "minmax":
            lo, hi = jnp.min(xf), jnp.max(xf)
            span = hi - lo
            v = (xf - lo) / jnp.where(span > 0, span, 1.0) * levels
            return jnp.clip(_rounded(v, key, stochastic), 0.0, levels), jnp.stack([lo, hi])
        if scale == "tensor":
            s = jnp.max(jnp.abs(xf)).astype(scale_dtype)
            s32 = s.astype(jnp.float32)
        else:
            red = feature_axes(x.ndim)
            s = jnp.max(jnp.abs(xf), axis=red).astype(scale_dtype)
            s32 = jnp.expand_dims(s.astype(jnp.float32), red)
        v = xf / (s32 + _EPS) * half
        return jnp.clip(_rounded(v, key, stochastic), -half, half - 1.0) + half, s

    def decode(q, s, shape, dtype):
        s = s.astype(jnp.float32)
        if scale == "minmax":
            x_hat = q / levels * (s[1] - s[0]) + s[0]
        else:
            if scale == "feature":
                s = jnp.expand_dims(s, feature_axes(len(shape)))
            x_hat = (q - half) / half * s
        return x_hat.astype(dtype)

    def compress(x, state, key=None):
        q, s = codes_and_scale(x, key)
        codes = _bitpack.pack(q.astype(jnp.uint8).reshape(-1), bits)
        return QuantizedPayload(codes, s.astype(scale_dtype)), state

    def decompress(payload, like):
        n = math.prod(like.shape)
        q = _bitpack.unpack(payload.codes, n, bits).astype(jnp.float32).reshape(like.shape)
        return decode(q, payload.scale, like.shape, like.dtype)

    def roundtrip(x, state, key=None):
        q, s = codes_and_scale(x, key)
        s = s.astype(scale_dtype)
        codes = _bitpack.pack(q.astype(jnp.uint8).reshape(-1), bits)
        return QuantizedPayload(codes, s), state, decode(q, s, x.shape, x.dtype)

    def decode_sum(stacked, like):
        if scale == "feature" or bits not in (1, 2, 4, 8):
            return _base.sum_decoded(decompress, stacked, like)
        # per-tensor scales: decode in bit-plane layout, every payload in one fused pass
        planes = _bitpack.unpack_planes(stacked.codes, bits).astype(jnp.float32)
        acc = jnp.promote_types(like.dtype, jnp.float32)
        terms = [
            decode(planes[i], stacked.scale[i], (), like.dtype).astype(acc)
            for i in range(planes.shape[0])
        ]
        return _from_planes(sum(terms[1:], terms[0]), like)

    options = _base.Options(
        bits=bits, scale=scale, axes=axes, rounding=rounding, scale_dtype=scale_dtype
    )
    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, stochastic, None, roundtrip,
        decode_sum, options,
    )  # fmt: skip


def _from_planes(planes: jax.Array, like) -> jax.Array:
    """Values in bit-plane layout ``[planes, m]`` back in ``like``'s shape (drops the padding)."""
    return planes.reshape(-1)[: math.prod(like.shape)].reshape(like.shape)


def sign(*, scale: str = "mean_abs") -> _base.Codec:
    r"""1-bit sign compression with one scale, signs packed 8 per byte.

    .. math::
      \hat x = s \cdot \mathrm{sign}(x), \quad s = \tfrac{1}{n}\|x\|_1 \ \text{(``mean_abs``)}
      \ \text{or}\ s = \|x\|_2 / \sqrt{n} \ \text{(``rms``)}

    A 1-bit code cannot encode zero: zero entries decode to ``+s`` (an all-zero tensor has
    ``s = 0`` and decodes to exact zeros). Use with error feedback (EF-SignSGD).

    Args:
      scale: ``"mean_abs"`` (EF-SignSGD's :math:`\|x\|_1/n`, the MSE-optimal scale) or ``"rms"``.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`QuantizedPayload` payloads
      (``ceil(n/8)`` bytes + one ``float32`` scale).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.sign()
      >>> x = jnp.array([2.0, -1.0, 3.0, -2.0])
      >>> payload, _ = codec.compress(x, codec.init(x), None)
      >>> codec.decompress(payload, x)
      Array([ 2., -2.,  2., -2.], dtype=float32)

    References:
      Karimireddy et al., `Error Feedback Fixes SignSGD and other Gradient Compression Schemes
      <https://arxiv.org/abs/1901.09847>`_, 2019.
    """
    _base.check_choice("scale", scale, ("mean_abs", "rms"))
    name = f"sign({scale})"

    def init(x):
        _base.check_float(x, name)
        return _base.EmptyState()

    def signs_and_scale(x):
        _base.check_float(x, name)
        xf = x.astype(jnp.float32)
        s = jnp.mean(jnp.abs(xf)) if scale == "mean_abs" else jnp.sqrt(jnp.mean(xf * xf))
        # a NaN entry makes the scale NaN so the decoded tensor is NaN, never finite garbage
        return (xf >= 0).astype(jnp.uint8), s

    def compress(x, state, key=None):
        del key
        bits, s = signs_and_scale(x)
        return QuantizedPayload(_bitpack.pack(bits.reshape(-1), 1), s), state

    def decompress(payload, like):
        n = math.prod(like.shape)
        bits = _bitpack.unpack(payload.codes, n, 1).astype(jnp.float32)
        return ((2.0 * bits - 1.0) * payload.scale).reshape(like.shape).astype(like.dtype)

    def roundtrip(x, state, key=None):
        del key
        bits, s = signs_and_scale(x)
        x_hat = ((2.0 * bits.astype(jnp.float32) - 1.0) * s).astype(x.dtype)
        return QuantizedPayload(_bitpack.pack(bits.reshape(-1), 1), s), state, x_hat

    def decode_sum(stacked, like):
        planes = _bitpack.unpack_planes(stacked.codes, 1).astype(jnp.float32)
        acc = jnp.promote_types(like.dtype, jnp.float32)
        terms = [
            ((2.0 * planes[i] - 1.0) * stacked.scale[i]).astype(like.dtype).astype(acc)
            for i in range(planes.shape[0])
        ]
        return _from_planes(sum(terms[1:], terms[0]), like)

    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, False, None, roundtrip,
        decode_sum, _base.Options(scale=scale),
    )  # fmt: skip
