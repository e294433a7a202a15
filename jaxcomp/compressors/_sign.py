"""1-bit sign compression with one scale (mean absolute value or RMS), signs packed 8 per
byte in the quantizers' payload (:class:`~jaxcomp.compressors.QuantizedPayload`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxcomp import _scaling
from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.compressors import _bitpack
from jaxcomp.compressors import _checks
from jaxcomp.compressors import _quantize


def _rms(xf: jax.Array) -> jax.Array:
    """``sqrt(mean(x**2))`` without under/overflow of the squares.

    Squares of float32 under/overflow outside |x| in ~[1e-19, 1e19]; only then (a mean square
    outside [1e-30, 1e30], or zero) is it recomputed from ``x * 2**-e``, ``e`` the exponent of
    max|x| (a second pass over ``x``). NaN and Inf give a non-finite result either way.
    """
    ms = jnp.mean(jnp.square(xf))

    def rescaled(xf):
        f = _scaling.pow2_inverse(jnp.max(_checks.nan_as_inf(jnp.abs(xf))))
        return jnp.sqrt(jnp.mean(jnp.square(xf * f))) / f

    return jax.lax.cond((ms < 1e-30) | (ms > 1e30), rescaled, lambda xf: jnp.sqrt(ms), xf)


def _mean_abs(xf: jax.Array) -> jax.Array:
    """``mean(|x|)`` without overflow of the sum.

    The float32 sum of ``|x|`` overflows for entries near ``3e38 / size`` while the mean is
    finite; only then (an infinite or NaN sum) is it recomputed from ``|x| * 2**-e``, ``e`` the
    exponent of max|x| (exact: a second pass over ``x``). NaN and Inf give a non-finite result
    either way. A mean below ``2**-126`` (inputs near ``1e-38``) is flushed to zero on the CPU
    backend (``jaxcomp._cpu`` [subnormals]).
    The ``lax.cond`` costs nothing measurable; one pass with a second, scaled sum instead is not
    fused into one reduction and doubles the encode (timings: ``docs/performance.md``).
    """
    s = jnp.mean(jnp.abs(xf))

    def rescaled(xf):
        f = _scaling.pow2_inverse(jnp.max(_checks.nan_as_inf(jnp.abs(xf))))
        return jnp.mean(jnp.abs(xf) * f) / f

    return jax.lax.cond(jnp.isfinite(s), lambda xf: s, rescaled, xf)


def sign(*, scale: str = "mean_abs") -> _base.Codec:
    r"""1-bit sign compression with one scale, signs packed 8 per byte.

    .. math::
      \hat x = s \cdot \mathrm{sign}(x), \quad s = \tfrac{1}{n}\|x\|_1 \ \text{(``mean_abs``)}
      \ \text{or}\ s = \|x\|_2 / \sqrt{n} \ \text{(``rms``)}

    A 1-bit code cannot encode zero: zero entries decode to ``+s`` (an all-zero tensor has ``s = 0``
    and decodes to exact zeros). Use with error feedback (EF-SignSGD). The error relative to
    :math:`\|x\|` does not depend on the input's magnitude (1e-30 to 3.1e38 are tested, with and
    without error feedback; where ``"rms"``'s squares would under/overflow or ``"mean_abs"``'s sum
    overflow, a second pass reads ``x`` rescaled by a power of two). A scale below ``2**-126``
    (inputs near 1e-38 and below; the CPU backend reads and writes subnormals as zero,
    ``jaxcomp._cpu`` [subnormals]) decodes to zeros. A NaN entry makes every entry decode to NaN, an
    Inf entry every entry to +-Inf (or NaN); a zero-size input decodes to an empty array.

    Args:
      scale: ``"mean_abs"`` (EF-SignSGD's :math:`\|x\|_1/n`, the MSE-optimal scale) or ``"rms"``.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with
      :class:`~jaxcomp.compressors.QuantizedPayload` payloads (``ceil(n/8)`` bytes + one
      ``float32`` scale).

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
    _validate.check_choice("scale", scale, ("mean_abs", "rms"))
    name = f"sign({scale})"

    def init(x):
        _base.check_float(x, name)
        return _base.EmptyState()

    def signs_and_scale(x):
        _base.check_float(x, name)
        xf = x.astype(jnp.float32)
        if xf.size == 0:
            return xf.astype(jnp.uint8), jnp.zeros((), jnp.float32)
        if scale == "mean_abs":
            s = _mean_abs(xf)
        else:
            s = _rms(xf)
        # a sum keeps NaN and Inf (CPU: jaxcomp._cpu [nan-max]), so a non-finite entry
        # makes the scale non-finite and every entry decodes non-finite, never finite garbage
        return (xf >= 0).astype(jnp.uint8), s

    def check_payload(payload, like, lead=()):
        n = math.prod(like.shape)
        _checks.check_fits(
            name,
            like,
            [
                ("codes", payload.codes, (*lead, _bitpack.packed_size(n, 1)), jnp.uint8),
                ("scale", payload.scale, lead, jnp.float32),
            ],
        )

    def compress(x, state, key=None):
        del key
        bits, s = signs_and_scale(x)
        return _quantize.QuantizedPayload(_bitpack.pack(bits.reshape(-1), 1), s), state

    def decompress(payload, like):
        check_payload(payload, like)
        n = math.prod(like.shape)
        bits = _bitpack.unpack(payload.codes, n, 1).astype(jnp.float32)
        return ((2.0 * bits - 1.0) * payload.scale).reshape(like.shape).astype(like.dtype)

    def roundtrip(x, state, key=None):
        del key
        bits, s = signs_and_scale(x)
        x_hat = ((2.0 * bits.astype(jnp.float32) - 1.0) * s).astype(x.dtype)
        return _quantize.QuantizedPayload(_bitpack.pack(bits.reshape(-1), 1), s), state, x_hat

    def decode_sum(stacked, like):
        check_payload(stacked, like, lead=stacked.codes.shape[:1])
        planes = _bitpack.unpack_planes(stacked.codes, 1).astype(jnp.float32)
        acc = jnp.promote_types(like.dtype, jnp.float32)
        terms = [
            ((2.0 * planes[i] - 1.0) * stacked.scale[i]).astype(like.dtype).astype(acc)
            for i in range(planes.shape[0])
        ]
        return _quantize.from_planes(sum(terms[1:], terms[0]), like)

    return _base.Codec(
        init, compress, decompress, name, _base.Reduction.GATHER, False, None, roundtrip,
        decode_sum,
    )  # fmt: skip
