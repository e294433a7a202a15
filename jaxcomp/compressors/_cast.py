"""The identity codec and 16-bit float casts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _validate
from jaxcomp.compressors import _base
from jaxcomp.compressors import _checks

_CASTS = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def identity() -> _base.Codec:
    """The codec that sends its input unchanged (the uncompressed baseline).

    NaN and +-Inf pass through unchanged; ``decompress`` raises ``ValueError`` when the payload's
    shape is not ``like``'s.

    Returns:
      A :class:`~jaxcomp.compressors.Codec` whose payload is ``x`` itself; payloads from
      several workers can be summed with ``psum``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.identity()
      >>> x = jnp.arange(3.0)
      >>> codec.decompress(codec.compress(x, codec.init(x), None)[0], x)
      Array([0., 1., 2.], dtype=float32)
    """

    def init(x):
        del x
        return _base.EmptyState()

    def compress(x, state, key=None):
        del key
        return x, state

    def decompress(payload, like):
        _checks.check_fits("identity", like, [("payload", payload, tuple(like.shape), None)])
        return payload.astype(like.dtype)

    def psum(payload, axis_name):
        return jax.lax.psum(payload, axis_name)

    return _base.Codec(init, compress, decompress, "identity", _base.Reduction.SUM, False, psum)


def cast(dtype="bfloat16") -> _base.Codec:
    """Rounds to a 16-bit float and sends the 16-bit words.

    The payload is the ``uint16`` bit pattern of the rounded value
    (``lax.bitcast_convert_type``): the CPU backend widens ``bfloat16`` collectives to
    ``float32`` (``jaxcomp._cpu`` [widened-collectives]), while ``uint16`` travels as two
    bytes on every backend.
    Rounding is round-to-nearest-even; NaN stays NaN and ``+-inf`` stays ``+-inf``.

    The relative error is at most ``2**-8`` (``bfloat16``) or ``2**-11`` (``float16``) over
    the format's normal range, which for ``bfloat16`` is ``float32``'s (1.2e-38 to 3.4e38).
    ``float16``'s normal range is only ``[6.1e-5, 65504]``: finite values above 65504 (above
    65520 after rounding) become ``+-inf``, so they decode non-finite, never to a wrong finite
    value; values below 6.1e-5 are subnormal and lose relative precision, and below 3e-8 they
    flush to ``+-0`` (a gradient of magnitude 1e-8 decodes to zero). Use ``bfloat16`` for
    gradients unless they are known to lie in ``float16``'s range.

    Args:
      dtype: ``"bfloat16"`` (8 exponent bits, range of ``float32``) or ``"float16"``
        (IEEE half: more mantissa, overflows above 65504).

    Returns:
      A :class:`~jaxcomp.compressors.Codec` with a ``uint16`` payload of ``x``'s shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import compressors
      >>> codec = compressors.cast("float16")
      >>> x = jnp.array([1.0, 1 / 3])
      >>> payload, _ = codec.compress(x, codec.init(x), None)
      >>> payload.dtype, codec.decompress(payload, x)
      (dtype('uint16'), Array([1.        , 0.33325195], dtype=float32))
    """
    dtype_name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    _validate.check_choice("dtype", dtype_name, tuple(_CASTS))
    target = _CASTS[dtype_name]
    name = f"cast({dtype_name})"

    def init(x):
        _base.check_float(x, name)
        return _base.EmptyState()

    def compress(x, state, key=None):
        del key
        _base.check_float(x, name)
        return jax.lax.bitcast_convert_type(x.astype(target), jnp.uint16), state

    def decompress(payload, like):
        _checks.check_fits(name, like, [("payload", payload, tuple(like.shape), jnp.uint16)])
        return jax.lax.bitcast_convert_type(payload, target).astype(like.dtype)

    def psum(payload, axis_name):
        total = jax.lax.psum(jax.lax.bitcast_convert_type(payload, target), axis_name)
        return jax.lax.bitcast_convert_type(total, jnp.uint16)

    return _base.Codec(init, compress, decompress, name, _base.Reduction.SUM, False, psum)
