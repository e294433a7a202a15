"""Packing of b-bit integer codes (1 <= b <= 8) into ``uint8`` bytes, exactly ``ceil(n*b/8)``-ish.

Layout: ``b`` is split into its binary parts (e.g. 7 = 4 + 2 + 1, 3 = 2 + 1). Each part of width
``w`` in {1, 2, 4, 8} is packed *planar*: the flat code array (padded to a multiple of ``8/w``)
is cut into ``8/w`` equal planes and byte ``i`` holds plane ``j``'s element ``i`` in bits
``[j*w, (j+1)*w)``. Planar packing is a handful of elementwise ops and one concatenate, which
XLA fuses into a single pass (JAX-NOTES §3: 4-bit planar unpack runs at ~25 GB/s on CPU,
interleaved at 1.4-4.9x a copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_PARTS = {
    1: (1,),
    2: (2,),
    3: (2, 1),
    4: (4,),
    5: (4, 1),
    6: (4, 2),
    7: (4, 2, 1),
    8: (8,),
}


def _part_shifts(bits: int) -> list[tuple[int, int]]:
    """(width, bit offset inside the code) for each binary part of ``bits``."""
    out, offset = [], 0
    for width in _PARTS[bits]:
        out.append((width, offset))
        offset += width
    return out


def packed_size(n: int, bits: int) -> int:
    """Number of bytes :func:`pack` returns for ``n`` codes of ``bits`` bits."""
    total = 0
    for width, _ in _part_shifts(bits):
        per_byte = 8 // width
        total += -(-n // per_byte)
    return total


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Packs a flat array of unsigned codes ``< 2**bits`` into a flat ``uint8`` array.

    Args:
      codes: 1-D integer array, values in ``[0, 2**bits)``.
      bits: code width, 1..8.

    Returns:
      ``uint8[packed_size(n, bits)]``.
    """
    codes = codes.astype(jnp.uint8)
    if bits == 8:
        return codes
    n = codes.shape[0]
    chunks = []
    for width, offset in _part_shifts(bits):
        per_byte = 8 // width
        m = -(-n // per_byte)
        field = (codes >> offset) & ((1 << width) - 1) if bits != width else codes
        field = jnp.pad(field, (0, m * per_byte - n)).reshape(per_byte, m)
        byte = field[0]
        for j in range(1, per_byte):
            byte = byte | (field[j] << (j * width))
        chunks.append(byte)
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks)


def _unpack_eighths(packed: jax.Array, n: int, bits: int) -> jax.Array:
    """:func:`unpack` for ``n % 8 == 0`` with broadcast shifts only (no concatenate).

    With ``m = n / 8``, a part of width ``w`` holds ``8 / w`` planes of ``w m`` entries, i.e.
    byte ``h m + j`` (``h < w``) of it holds entries ``(p w + h) m + j`` for the planes ``p``:
    every part decodes straight into the ``[8, m]`` layout of the codes, whose row-major order
    is the entries' order. On the CPU backend a fusion through concatenates (the general path)
    runs ~3x slower than a copy (``jaxcomp._cpu`` [slow-ops]); this one fuses into one pass.
    """
    m = n // 8
    codes = None
    start = 0
    for width, offset in _part_shifts(bits):
        per_byte = 8 // width
        byte = packed[start : start + width * m].reshape(1, width, m)
        start += width * m
        shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * width)[:, None, None]
        field = ((byte >> shifts) & jnp.uint8((1 << width) - 1)).reshape(8, m)
        part = field << offset if offset else field
        codes = part if codes is None else codes | part
    return codes.reshape(n)


def unpack(packed: jax.Array, n: int, bits: int) -> jax.Array:
    """Inverse of :func:`pack`: ``uint8[n]`` codes from the packed bytes."""
    if bits == 8:
        return packed
    if n % 8 == 0 and n > 0:
        return _unpack_eighths(packed, n, bits)
    codes = None
    start = 0
    for width, offset in _part_shifts(bits):
        per_byte = 8 // width
        m = -(-n // per_byte)
        byte = packed[start : start + m]
        start += m
        mask = (1 << width) - 1
        planes = [(byte >> (j * width)) & mask for j in range(per_byte)]
        field = jnp.concatenate(planes)[:n] if per_byte > 1 else byte
        part = field << offset if offset else field
        codes = part if codes is None else codes | part
    return codes.astype(jnp.uint8)


def unpack_planes(packed: jax.Array, bits: int) -> jax.Array:
    """The codes of :func:`pack` as planes ``uint8[..., 8 // bits, m]``, for bits 1, 2, 4, 8.

    ``unpack(p, n, bits) == unpack_planes(p, bits).reshape(-1)[:n]``; leading axes of
    ``packed`` (several payloads) are kept. A broadcast shift instead of :func:`unpack`'s
    concatenate: a fusion that decodes several payloads at once through concatenates runs
    ~5x slower on the CPU backend (``jaxcomp._cpu`` [slow-ops]), through planes at memory speed.
    """
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"unpack_planes needs bits in (1, 2, 4, 8); got {bits}.")
    planes = packed[..., None, :]
    if bits == 8:
        return planes
    shifts = (jnp.arange(8 // bits, dtype=jnp.uint8) * bits)[:, None]
    return (planes >> shifts) & jnp.uint8((1 << bits) - 1)
