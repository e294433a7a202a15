"""Generic reduction protocols built from a codec: how payloads cross a data-parallel axis.

:func:`jaxcomp.comm.plan_reduce` picks one per array (or the codec's own protocol, e.g.
PowerSGD's) and wraps it in the channel's error compensation:

============  ==========================================================  =====================
path          what crosses the wire (per worker)                           codecs
============  ==========================================================  =====================
dense         ``lax.pmean`` of ``x`` itself                                any (fallback)
psum          ``codec.psum`` of the payload (summable in place)           ``Reduction.SUM``:
                                                                           identity, cast, RandK
all_gather    ``all_gather`` of payloads; each worker decodes W of them    any (TopK, quantize,
              and sums                                                     sign, composed)
two_phase     ``all_to_all`` of W compressed chunks; each worker decodes   any
              and sums its chunk, adds a *server* residual, re-compresses
              it and ``all_gather``s it: bytes per worker stay flat in W
codec         the codec's own :class:`~jaxcomp.compressors.ReduceProtocol` ``Codec.protocol``
              (PowerSGD: two ``psum``s of small factors)                   (power_sgd, yours)
============  ==========================================================  =====================

Every protocol returns ``(mean, echo, state)``, ``echo`` being this worker's decoded payload
(computed with :func:`~jaxcomp.compressors.compress_and_decode`, so error feedback gets it from
the codec's fused round trip; on the ``all_gather`` path a codec with
``Codec.echo_from_wire`` decodes its payload as gathered, behind the collective); the
``psum`` and ``all_gather`` paths of a codec with an in-place decode (``Codec.add_decoded``:
TopK) also have ``all_reduce_into``, which adds the echo into the residual (or EF21's estimate)
with :func:`~jaxcomp.compressors.compress_into`, a scatter in place; for other codecs the
compensation forms ``base + sign * echo`` itself, fused with the echo's decode. Receivers
decode gathered payloads with the codec's fused :func:`~jaxcomp.compressors.decode_sum` in
passes of up to eight payloads.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import compressors
from jaxcomp._bits import move_as_bits
from jaxcomp.compressors import _base
from jaxcomp.compressors import _protocol

DECODE_CHUNK = 8  #: gathered payloads decoded per fused pass (unrolled inside the pass)


class DenseReduce(NamedTuple):
    """State of an array averaged uncompressed with ``lax.pmean`` (there is none)."""


class PsumReduce(NamedTuple):
    """State of the ``psum`` path.

    Attributes:
      codec: :class:`~jaxcomp.compressors.PerWorker`: this worker's codec state.
    """

    codec: _protocol.PerWorker


class GatherReduce(NamedTuple):
    """State of the ``all_gather`` path (fields as :class:`PsumReduce`)."""

    codec: _protocol.PerWorker


class TwoPhaseReduce(NamedTuple):
    """State of the ``two_phase`` path (every field per worker).

    Attributes:
      send: codec states of this worker's W chunks (leaves ``[1, W, ...]``).
      server: codec state of the chunk this worker reduces (leaves ``[1, ...]``).
      server_residual: ``[1, chunk]``: what re-compressing the reduced chunk dropped so far.
    """

    send: _protocol.PerWorker
    server: _protocol.PerWorker
    server_residual: _protocol.PerWorker


def codec_key(codec: compressors.Codec, key: jax.Array | None) -> jax.Array | None:
    """``key`` for a stochastic codec (a clear error without one), ``None`` otherwise."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(f"{codec.name} is stochastic: its reduction needs a PRNG key.")
    return key


def decode_mean(codec: compressors.Codec, stacked: Any, like: Any) -> jax.Array:
    """Mean of ``decompress(stacked[i], like)`` over the leading axis of ``stacked``.

    Payloads are decoded and summed :data:`DECODE_CHUNK` at a time with the codec's fused
    :func:`~jaxcomp.compressors.decode_sum` (e.g. one scatter-add of all TopK values), in a
    loop over chunks for many workers, so memory stays one array whatever W. Sums in
    ``float32`` (or wider); returns ``like``'s dtype. Where that sum overflows (decoded arrays
    near ``3e38 / W``) the mean is infinite, never finite and wrong: a rescue pass behind a
    ``lax.cond`` cost EF + quantize a leaf-sized temporary (not taken).
    """
    like = _base.as_like(like)
    num = jax.tree.leaves(stacked)[0].shape[0]
    full, rest = divmod(num, DECODE_CHUNK)

    def chunk(start, size):
        part = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, start, size), stacked)
        return compressors.decode_sum(codec, part, like)

    total = chunk(full * DECODE_CHUNK, rest) if rest else None
    if full == 1:
        first = chunk(0, DECODE_CHUNK)
        total = first if total is None else total + first
    elif full > 1:
        if total is None:
            leaves = jax.tree.leaves(stacked)
            vary = set().union(*(_protocol.varying_axes(x) for x in leaves))
            acc_dtype = jnp.promote_types(like.dtype, jnp.float32)
            total = _protocol.to_varying(jnp.zeros(like.shape, acc_dtype), tuple(vary))
        total = lax.fori_loop(
            0, full, lambda c, acc: acc + chunk(c * DECODE_CHUNK, DECODE_CHUNK), total
        )
    return (total / num).astype(like.dtype)


def dense_protocol() -> _protocol.ReduceProtocol:
    """``lax.pmean`` of the array itself; ``echo`` is the array."""

    def all_reduce(x, state, key, axis_name):
        del key
        return _protocol.pmean(x, axis_name), x, state

    return _protocol.ReduceProtocol(
        lambda like, num_workers=None: DenseReduce(),
        all_reduce,
        lambda like, num_workers: _protocol.reduced_bytes(_base.as_like(like)),
        "dense",
    )


def _init_codec(codec, like):
    return _protocol.PerWorker(jax.tree.map(lambda s: s[None], codec.init(_base.as_like(like))))


def psum_operand_bytes(codec: compressors.Codec, payload: Any) -> int | jax.Array:
    """Bytes of the operands of the ``psum``s in ``codec.psum`` (e.g. RandK's values; its
    shared seed does not travel), read from its jaxpr, as they cross on this backend
    (:func:`~jaxcomp.compressors._protocol.reduced_bytes`).

    Traced in a fresh thread: JAX's tracing context is thread-local, and a collective over an
    axis of its own cannot be traced inside another ``shard_map`` body (where transforms plan).
    """

    def trace():
        return jax.make_jaxpr(lambda p: codec.psum(p, "i"), axis_env=[("i", 2)])(payload)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        jaxpr = pool.submit(trace).result()
    operands = [v.aval for e in jaxpr.eqns if e.primitive.name == "psum" for v in e.invars]
    return _protocol.reduced_bytes(operands)


def in_place_only(codec: compressors.Codec, all_reduce_into):
    """``all_reduce_into`` for a codec that adds its decode in place (``Codec.add_decoded``),
    else ``None``: the protocol then offers no in-place sum, and error feedback forms
    ``c - echo`` in its own layout (fused with the decode, written into the donated residual)."""
    return all_reduce_into if codec.add_decoded is not None else None


def psum_protocol(codec: compressors.Codec) -> _protocol.ReduceProtocol:
    """``codec.psum`` of the payloads, made with the *shared* key (e.g. RandK positions).

    The codec sums its payloads in its own way (a 16-bit ``cast`` in 16 bits): where that sum
    overflows (W arrays near ``3e38 / W``) the mean is infinite, never finite and wrong
    (``tests/comm/test_reduce_magnitudes.py``), as on the ``all_gather`` and ``two_phase``
    paths (:func:`decode_mean`); ``dense`` and PowerSGD are exact there.
    """
    if codec.reduction is not compressors.Reduction.SUM or codec.psum is None:
        raise ValueError(
            f"path='psum' needs a summable codec (Reduction.SUM: identity, cast, rand_k); "
            f"{codec.name} is {codec.reduction.value}. Use 'all_gather' or 'two_phase'."
        )

    def all_reduce_into(x, state, key, axis_name, base, direction):
        num = _protocol.axis_size(axis_name)
        payload, codec_state, echo, into = compressors.compress_into(
            codec, x, _protocol.this_worker(state.codec), codec_key(codec, key), base, direction
        )
        total = payload if axis_name is None else codec.psum(payload, axis_name)
        mean = codec.decompress(total, x) / num
        return mean, echo, into, PsumReduce(_protocol.per_worker(codec_state, axis_name))

    def all_reduce(x, state, key, axis_name):
        mean, echo, _, state = all_reduce_into(x, state, key, axis_name, x, 1)
        return mean, echo, state

    def wire_bytes(like, num_workers):
        del num_workers
        return psum_operand_bytes(codec, compressors.payload_shape(codec, like))

    return _protocol.ReduceProtocol(
        lambda like, num_workers=None: PsumReduce(_init_codec(codec, like)),
        all_reduce,
        wire_bytes,
        f"{codec.name}/psum",
        all_reduce_into=in_place_only(codec, all_reduce_into),
    )


def gather_protocol(codec: compressors.Codec) -> _protocol.ReduceProtocol:
    """``all_gather`` of the payloads (each worker's own key); every worker decodes all."""

    def all_reduce_into(x, state, key, axis_name, base, direction):
        key = _protocol.worker_key(codec_key(codec, key), axis_name)
        codec_state = _protocol.this_worker(state.codec)
        if not codec.echo_from_wire or axis_name is None:
            # (exact TopK: the gathered-echo form below made its EF step 1.3x slower, A/B)
            payload, codec_state, echo, into = compressors.compress_into(
                codec, x, codec_state, key, base, direction
            )
            gathered = _protocol.all_gather(payload, axis_name)
        else:
            # the echo decoded from this worker's payload as gathered: the collective stops the CPU
            # backend fusing the selection into the decode (CPU: jaxcomp._cpu [fusion]; an
            # optimization barrier does not), where it would be redone per decoded entry (blockwise
            # TopK: a block's arg-max per entry, 8x the step). The in-place sum takes the local
            # payload (a scatter, not fused with the selection): taken from the gathered one, it
            # held the compressed array live across the collective in a buffer of its own (blockwise
            # TopK + EF: 8 MiB more temporaries per leaf, one-process A/B in the commit)
            payload, codec_state = codec.compress(x, codec_state, key)
            into = compressors.add_decoded(codec, base, payload, direction)
            gathered = _protocol.all_gather(payload, axis_name)
            me = lax.axis_index(axis_name)
            mine = jax.tree.map(lambda p: lax.dynamic_index_in_dim(p, me, keepdims=False), gathered)
            echo = codec.decompress(mine, x)
        mean = decode_mean(codec, gathered, x)
        return mean, echo, into, GatherReduce(_protocol.per_worker(codec_state, axis_name))

    def all_reduce(x, state, key, axis_name):
        mean, echo, _, state = all_reduce_into(x, state, key, axis_name, x, 1)
        return mean, echo, state

    return _protocol.ReduceProtocol(
        lambda like, num_workers=None: GatherReduce(_init_codec(codec, like)),
        all_reduce,
        lambda like, num_workers: compressors.wire_bytes(compressors.payload_shape(codec, like)),
        f"{codec.name}/all_gather",
        all_reduce_into=in_place_only(codec, all_reduce_into),
    )


def chunk_like(like, num_workers: int) -> jax.ShapeDtypeStruct:
    """The flat chunk of ``like`` that one worker reduces on the ``two_phase`` path."""
    return jax.ShapeDtypeStruct((-(-math.prod(like.shape) // num_workers),), like.dtype)


def two_phase_protocol(codec: compressors.Codec) -> _protocol.ReduceProtocol:
    """All-to-all of W compressed chunks, a server-side residual, all-gather of the results.

    Its state is sized by the number of workers: ``init`` needs it (inside ``shard_map``, or
    under ``jax.set_mesh(mesh)``). The mean is re-compressed by the server, so it is not the
    exact mean of the workers' echoes (EF21 cannot run on it).
    """
    name = f"{codec.name}/two_phase"

    def init(like, num_workers=None):
        if num_workers is None:
            raise ValueError(
                f"{name}: the two-phase state is sized by the number of workers; call init "
                "inside shard_map or under `with jax.set_mesh(mesh):` (data_parallel does)."
            )
        chunk = chunk_like(like, num_workers)
        send = jax.tree.map(
            lambda s: jnp.broadcast_to(s, (num_workers, *s.shape)), codec.init(chunk)
        )
        return TwoPhaseReduce(
            _protocol.PerWorker(jax.tree.map(lambda s: s[None], send)),
            _init_codec(codec, chunk),
            _protocol.per_worker_zeros(chunk),
        )

    def all_reduce(x, state, key, axis_name):
        num = _protocol.axis_size(axis_name)
        like = _base.as_like(x)
        n = math.prod(like.shape)
        chunk = chunk_like(like, num)
        flat = jnp.pad(x.reshape(-1), (0, num * chunk.shape[0] - n)).reshape(num, -1)
        k_send = k_server = keys = None
        if codec.stochastic:
            k_send, k_server = jax.random.split(
                _protocol.worker_key(codec_key(codec, key), axis_name)
            )
            keys = jax.random.split(k_send, num)
        sends = _protocol.this_worker(state.send)
        payloads, send, echo = jax.vmap(
            lambda c, s, k: compressors.compress_and_decode(codec, c, s, k)
        )(flat, sends, keys)

        # phase 1: worker j receives chunk j from everyone, decodes and averages it
        moved = payloads
        if axis_name is not None:
            moved = move_as_bits(
                lambda t: jax.tree.map(lambda p: lax.all_to_all(p, axis_name, 0, 0, tiled=True), t),
                moved,
            )
        mine = decode_mean(codec, moved, chunk)
        _protocol.this_worker(state.server_residual)  # checks the layout
        corrected = mine[None] + state.server_residual.value  # [1, chunk]: updated in place
        server_payload, server, decoded = compressors.compress_and_decode(
            codec, corrected[0], _protocol.this_worker(state.server), k_server
        )
        # phase 2: everyone gathers every re-compressed chunk
        gathered = _protocol.all_gather(server_payload, axis_name)
        mean = jax.vmap(lambda p: codec.decompress(p, chunk))(gathered).reshape(-1)[:n]
        new_state = TwoPhaseReduce(
            _protocol.per_worker(send, axis_name),
            _protocol.per_worker(server, axis_name),
            _protocol.per_worker(corrected - decoded[None], axis_name, stacked=True),
        )
        echo = echo.reshape(-1)[:n].reshape(like.shape)
        return mean.reshape(like.shape), echo, new_state

    def wire_bytes(like, num_workers):
        chunk = chunk_like(like, num_workers)
        payload = compressors.payload_shape(codec, chunk)
        return (num_workers + 1) * compressors.wire_bytes(payload)

    return _protocol.ReduceProtocol(init, all_reduce, wire_bytes, name, exact_mean=False)
