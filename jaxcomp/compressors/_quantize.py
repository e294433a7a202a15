"""Uniform quantization to 1-8 bits, bit-packed into ``uint8``.

Three scale modes, as in the papers:

* ``"tensor"``: symmetric, one absmax scale per tensor.
* ``"feature"``: symmetric, one absmax scale per feature position, the max taken over ``axes``
  (default ``(0,)``, the batch axis) — AC-SGD's
  ``_compress_nbits(scale_method='max', scale_dims=(0,))`` used by Rudakov et al.
* ``"minmax"``: affine with one global ``(min, max)`` pair — Rudakov et al.'s
  ``quantize_custom`` ("quantization_simple").

Symmetric modes use AC-SGD's levels (``h = 2**(bits-1)``, ``s`` the scale as sent)::

  q = clip(round(x / s * h), -h, h - 1);             x_hat = q / h * s

so the error is at most ``s / (2h)`` inside the range and ``s / h`` at the clipped top level.
AC-SGD divides by ``s + 1e-6``, an absolute term that swamps tensors of magnitude 1e-6 and
below (relative error 0.2 at 1e-6, ~1 at 1e-8); here an all-zero group has ``s = 0`` and
decodes to exact zeros, and the error is relative to ``s`` at every magnitude.
The min-max mode uses ``L = 2**bits - 1`` levels::

  q = round((x - lo) / (hi - lo) * L);               x_hat = q / L * (hi - lo) + lo

with error at most ``(hi - lo) / (2L)``. A constant tensor (``hi == lo``) decodes exactly.
Stochastic rounding replaces ``round(v)`` by ``floor(v + u)``, ``u ~ U[0, 1)``, which is unbiased
inside the range; the error is then below one step.

Scales travel in ``scale_dtype``, rounded *outwards* (an absmax or ``hi`` up, ``lo`` down) so that
no entry falls outside the range the receiver decodes. Feature scales travel as ``bfloat16`` by
default (as the ``uint16`` bit pattern, because the CPU backend widens ``bfloat16`` collectives,
``jaxcomp._cpu`` [widened-collectives]): two bytes like AC-SGD's ``float16``, but with ``float32``'s
range, at the cost of a scale up to ``2**-7`` (relative) coarser. ``scale_dtype=jnp.float16``
reproduces AC-SGD's wire format and its limits: a group whose max exceeds 65504 gets an infinite
scale and decodes to non-finite values; below 6.1e-5 the scale is subnormal, rounded up to a
multiple of ``2**-24`` (6e-8), so the error is up to ``6e-8 / h`` *absolute* and a group whose max
is far below that decodes with relative errors of 1 or more.

Non-finite inputs are never made finite, for every size, jitted or not: an Inf makes its scale
group's scale ``+inf`` (min-max: ``hi = +inf`` or ``lo = -inf``) and a NaN *anywhere* makes
every scale ``+inf`` (min-max: ``hi``), so every entry of those groups decodes to NaN or +-Inf.
The CPU backend's vectorised ``max`` drops NaN on large arrays (``jaxcomp._cpu`` [nan-max]), so
NaN is detected from the tensor's
sum, which keeps it; every scale mode tests the sum of magnitudes (or of the elementwise folds
that take the maxima over leading axes), which overflows to ``+inf`` at worst, so a finite
tensor is never taken for a NaN, however large (a signed sum, overflowing both ways, would be).
Up to float32's largest (3.4e38) the error stays
within its bound: a scale above ``2**64`` divides ``x * 2**-64`` by ``s * 2**-64`` (on the CPU
backend ``x / s`` is ``x * (1 / s)``, whose subnormal reciprocal is flushed to 0:
``jaxcomp._cpu`` [subnormals]), and a min-max span past
the float32 range decodes as the interpolation ``t hi + (1 - t) lo``. A zero-size input gives
an empty payload (all-zero scales) and decodes to an empty array.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.compressors import _bitpack
from jaxcomp.compressors import _checks
from jaxcomp.compressors import _noise

SCALE_MODES = ("tensor", "feature", "minmax")
ROUNDING_MODES = ("nearest", "stochastic")
SCALE_DTYPES = ("float16", "bfloat16", "float32")
_FOLD = _checks.FOLD_MIN_FEATURES


class QuantizedPayload(NamedTuple):
    """Bit-packed codes and the scales needed to decode them.

    Attributes:
      codes: ``uint8[packed_size(n, bits)]``, the packed unsigned codes.
      scale: the scales in their wire dtype (``bfloat16`` as its ``uint16`` bits): ``[]``
        (tensor, default ``float32``), ``[feature shape]`` (feature, default ``bfloat16``) or
        ``[2]`` holding ``(lo, hi)`` (minmax, default ``float32``).
    """

    codes: jax.Array
    scale: jax.Array


def _rounded(v: jax.Array, key: jax.Array | None, stochastic: bool) -> jax.Array:
    if stochastic:
        return jnp.floor(v + _noise.uniform_noise(key, v.shape))
    return jnp.round(v)


def _outwards(s: jax.Array, dtype: np.dtype, up: bool) -> jax.Array:
    """``float32`` ``s`` rounded to ``dtype`` towards ``+inf`` (``up``) or ``-inf``."""
    w = s.astype(dtype)
    if dtype == np.dtype(jnp.float32):
        return w
    back = w.astype(jnp.float32)
    short = back < s if up else back > s
    return jnp.where(short, jnp.nextafter(w, jnp.asarray(np.inf if up else -np.inf, dtype)), w)


_SHRINK_ABOVE = 2.0**64


def _shrink(s: jax.Array) -> jax.Array:
    """``2**-64`` if the largest scale exceeds ``2**64``, else 1: ``x k / (s k)`` is ``x / s``.

    The CPU backend computes ``x / s`` as ``x * (1 / s)`` and flushes subnormals to zero
    (``jaxcomp._cpu`` [subnormals]), so for a scale
    above ``2**126`` (inputs near ``1e38``) the reciprocal is 0 and every code the midpoint.
    Scaling both by a power of two is exact (an ``x`` that underflows is below the code's
    resolution by ``2**60`` and more); at ``s <= 2**64`` it multiplies by 1, bit-identically.
    One ``k`` per tensor (a ``k`` per feature scale costs a second broadcast operand per entry,
    ``docs/performance.md``); its limit: when a tensor's largest
    feature scale exceeds ``2**64``, a feature whose scale is below ``2**-62`` (a dynamic range
    beyond ``2**126`` inside one tensor) decodes as zeros.
    """
    return jnp.where(s > _SHRINK_ABOVE, 1.0 / _SHRINK_ABOVE, 1.0).astype(jnp.float32)


def _wire_dtype(scale_dtype: np.dtype) -> np.dtype:
    return np.dtype(jnp.uint16) if scale_dtype == np.dtype(jnp.bfloat16) else scale_dtype


def _to_wire(w: jax.Array) -> jax.Array:
    if w.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(w, jnp.uint16)
    return w


def _from_wire(s: jax.Array) -> jax.Array:
    if s.dtype == jnp.uint16:
        s = jax.lax.bitcast_convert_type(s, jnp.bfloat16)
    return s.astype(jnp.float32)


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
      \hat x = \frac{\mathrm{clip}(\lfloor x h / s \rceil, -h, h - 1)}{h} s,
      \quad h = 2^{b-1}

    The relative error :math:`|\hat x - x| / s` is bounded (by :math:`1/h`) independently of
    the input's magnitude, from 1e-30 to 3e38 with the default scale dtypes (see the module
    docstring for the rounding of scales, ``float16`` scales and non-finite inputs).

    Args:
      bits: code width, 1..8.
      scale: ``"tensor"``, ``"feature"`` or ``"minmax"`` (see the module docstring).
      axes: for ``scale="feature"``, the axes the absmax is taken over (the rest index the
        scales). AC-SGD uses ``(0,)`` for CNN activations and ``(0, 1)`` for (batch, seq, emb).
      rounding: ``"nearest"`` (deterministic, the papers' default) or ``"stochastic"``
        (unbiased, needs a key; uses a fused integer-hash noise, not ``jax.random.uniform``).
      scale_dtype: ``float32``, ``bfloat16`` or ``float16``: the dtype the scales travel in.
        Default ``bfloat16`` for ``"feature"`` (sent as ``uint16`` bits) and ``float32``
        otherwise. ``float16`` is AC-SGD's: only for maxima in ``[6.1e-5, 65504]``.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with :class:`QuantizedPayload` payloads of
      ``ceil(n * bits / 8)`` code bytes plus the scales. ``decompress`` raises ``ValueError``
      for a payload whose codes or scales do not fit ``like``.

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
    _validate.check_int("bits", bits, 1, 8)
    _validate.check_choice("scale", scale, SCALE_MODES)
    _validate.check_choice("rounding", rounding, ROUNDING_MODES)
    if scale == "feature":
        if not isinstance(axes, (tuple, list)) or not all(isinstance(a, int) for a in axes):
            raise ValueError(f"axes must be a tuple of ints; got {axes!r}.")
        axes = tuple(axes)
    if scale_dtype is None:
        scale_dtype = jnp.bfloat16 if scale == "feature" else jnp.float32
    try:
        scale_dtype = np.dtype(scale_dtype)
    except TypeError:
        scale_dtype = None
    if scale_dtype is None or scale_dtype.name not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}; got {scale_dtype}.")
    wire_dtype = _wire_dtype(scale_dtype)
    stochastic = rounding == "stochastic"
    name = f"quantize({bits}, {scale}{', stochastic' if stochastic else ''})"
    half = float(2 ** (bits - 1))
    levels = float(2**bits - 1)

    def feature_axes(ndim: int) -> tuple[int, ...]:
        if any(a >= ndim or a < -ndim for a in axes):
            raise ValueError(f"{name}: axes {axes} out of range for a {ndim}-D input.")
        return tuple(sorted({a % ndim for a in axes}))

    def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        if scale == "tensor":
            return ()
        if scale == "minmax":
            return (2,)
        red = feature_axes(len(shape))
        return tuple(d for i, d in enumerate(shape) if i not in red)

    def init(x):
        _base.check_float(x, name)
        scale_shape(tuple(x.shape))
        return _base.EmptyState()

    def codes_and_scale(x, key):
        """Unsigned codes (float-valued) and the scale in its wire dtype."""
        _base.check_float(x, name)
        if stochastic:
            _base.check_key(key, name)
        xf = x.astype(jnp.float32)
        if scale == "minmax":
            if xf.size == 0:
                return xf, jnp.zeros((2,), wire_dtype)
            # a NaN makes hi = inf, so every entry decodes non-finite
            lo = _outwards(jnp.min(xf), scale_dtype, False)
            # |x|: a finite x whose sum overflows both ways is not taken for a NaN
            hi = jnp.where(_checks.has_nan(jnp.abs(xf)), jnp.inf, jnp.max(xf))
            hi = _outwards(hi, scale_dtype, True)
            lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
            k = _shrink(jnp.maximum(jnp.abs(lo32), jnp.abs(hi32)))
            span = hi32 * k - lo32 * k  # finite for every finite lo, hi
            v = (xf * k - lo32 * k) / jnp.where(span > 0, span, 1.0) * levels
            codes = jnp.clip(_rounded(v, key, stochastic), 0.0, levels)
            return codes, _to_wire(jnp.stack([lo, hi]))
        red = () if scale == "tensor" else feature_axes(x.ndim)
        rows = math.prod(xf.shape[: len(red)])
        if red and red == tuple(range(len(red))) and rows > 1 and xf.size >= rows * _FOLD:
            # leading axes: elementwise folds (NaN kept in its column) instead of a strided max
            absmax = _checks.leading_absmax(jnp.abs(xf).reshape(rows, -1))
            absmax = absmax.reshape(xf.shape[len(red) :])
            absmax = jnp.where(jnp.any(jnp.isnan(absmax)), jnp.inf, absmax)
        elif not red:  # per tensor: NaN makes the scale inf, in one read of a large xf
            absmax = _checks.tensor_absmax(xf)
        else:
            absmax = jnp.max(jnp.abs(xf), axis=red, initial=0.0)  # Inf: its group's
            # NaN: every scale inf (exactly NaN, as the folds, whatever the shape)
            absmax = jnp.where(_checks.has_nan(jnp.abs(xf)), jnp.inf, absmax)
        s = _outwards(absmax, scale_dtype, True)
        s32 = jnp.expand_dims(s.astype(jnp.float32), red)
        # half / (s k) is normal (s k <= 2**64), computed on the scales: one product per entry
        k = _shrink(jnp.max(s32, initial=0.0))  # zero-size: no scales
        v = xf * k * (half / jnp.where(s32 * k > 0, s32 * k, 1.0))
        codes = jnp.clip(_rounded(v, key, stochastic), -half, half - 1.0) + half
        return codes, _to_wire(s)

    def decode(q, s, shape, dtype):
        s = _from_wire(s)
        if scale == "minmax":
            span = s[1] - s[0]
            t = q / levels
            # lo and hi of opposite signs beyond 1.7e38: their span overflows, the
            # interpolation between them does not
            x_hat = jnp.where(jnp.isinf(span) & jnp.isfinite(s).all(),
                              t * s[1] + (1.0 - t) * s[0], t * span + s[0])  # fmt: skip
        else:
            if scale == "feature":
                s = jnp.expand_dims(s, feature_axes(len(shape)))
            x_hat = (q - half) / half * s
        return x_hat.astype(dtype)

    def check_payload(payload, like, lead=()):
        shape = tuple(like.shape)
        n = math.prod(shape)
        _checks.check_fits(
            name,
            like,
            [
                ("codes", payload.codes, (*lead, _bitpack.packed_size(n, bits)), jnp.uint8),
                ("scale", payload.scale, (*lead, *scale_shape(shape)), wire_dtype),
            ],
        )

    def compress(x, state, key=None):
        q, s = codes_and_scale(x, key)
        codes = _bitpack.pack(q.astype(jnp.uint8).reshape(-1), bits)
        return QuantizedPayload(codes, s), state

    def decompress(payload, like):
        check_payload(payload, like)
        n = math.prod(like.shape)
        q = _bitpack.unpack(payload.codes, n, bits).astype(jnp.float32).reshape(like.shape)
        return decode(q, payload.scale, like.shape, like.dtype)

    def roundtrip(x, state, key=None):
        q, s = codes_and_scale(x, key)
        # decode the codes as sent: a NaN code (an Inf or NaN input under an inf scale) is
        # code 0 on the wire (XLA converts NaN to 0), so the echo must decode it as 0 too
        q8 = q.astype(jnp.uint8)
        codes = _bitpack.pack(q8.reshape(-1), bits)
        return (
            QuantizedPayload(codes, s),
            state,
            decode(q8.astype(jnp.float32), s, x.shape, x.dtype),
        )

    def decode_sum(stacked, like):
        check_payload(stacked, like, lead=stacked.codes.shape[:1])
        if scale == "feature" or bits not in (1, 2, 4, 8):
            return _base.sum_decoded(decompress, stacked, like)
        # per-tensor scales: decode in bit-plane layout, every payload in one fused pass
        planes = _bitpack.unpack_planes(stacked.codes, bits).astype(jnp.float32)
        acc = jnp.promote_types(like.dtype, jnp.float32)
        terms = [
            decode(planes[i], stacked.scale[i], (), like.dtype).astype(acc)
            for i in range(planes.shape[0])
        ]
        return from_planes(sum(terms[1:], terms[0]), like)

    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, stochastic, None, roundtrip,
        decode_sum,
    )  # fmt: skip


def from_planes(planes: jax.Array, like) -> jax.Array:
    """Values in bit-plane layout ``[planes, m]`` back in ``like``'s shape (drops the padding)."""
    return planes.reshape(-1)[: math.prod(like.shape)].reshape(like.shape)
