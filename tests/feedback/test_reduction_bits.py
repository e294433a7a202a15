"""EF and EF21 around a 2-worker reduction keep their formulas bit for bit, signed zeros too.

``test_reduction_reference`` compares with ``assert_array_equal``, for which ``-0.0 == 0.0``;
the error-feedback paths may be rewritten for speed (a scatter into a buffer instead of a dense
subtraction), and a rewrite that turned a kept ``-0.0`` into ``+0.0`` (or the reverse) would
pass it. Here every output is compared as bit patterns (every NaN counts as one pattern):

* EF:   ``c = x + e``, ``e' = decay * (c - D(C(c)))`` (decay 1: exactly ``c - D(C(c))``);
* EF21: ``g' = g + D(C(x - g))``, where the scatter form may keep a ``-0.0`` of ``g`` that the
  dense sum turns into ``+0.0`` (``Codec.add_decoded``'s contract): only that may differ;
* the mean of both: ``((0 + D_0) + D_1) / W`` (the receivers' scatter-add into zeros).

Inputs hold NaN, +-inf, +-0.0 in ``x`` and in the memory (``-0.0 + -0.0`` stays ``-0.0``),
ties, and magnitudes 1e-10 .. 1e6, on both workers; the TopK codecs run on shapes that take
their fast paths (the sort-free select, the blockwise mask and scatter), on the all_gather
path, and RandK on the psum path. One program per codec computes EF (decay 1 and 0.5) and EF21;
exact TopK per tensor keeps its decay-0.5 residual in bfloat16 (``residual_dtype``: ``c = x +
f32(e)``, ``e' = bf16(0.5 (c - D(C(c))))``, the in-place path on a residual of another dtype).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.user_numerics,
]

W = 2
SHAPE = (256, 512)  # 131072 entries: exact TopK 1% takes the bracketed select (d > 65536)

#: (codec, shape, exact): ``exact`` is ``(fraction, per_sample)`` of an exact TopK, whose
#: ``D(C(c))`` is numpy's (``_exact_round_trip``: the select's programs take seconds to compile);
#: the others' is the codec's jitted round trip
CASES = [
    (compressors.top_k(0.01), SHAPE, (0.01, False)),  # exact, per tensor (+ bf16 residual)
    (compressors.top_k(0.05, per_sample=True), SHAPE, (0.05, True)),  # exact, per sample
    (compressors.top_k(0.1, method="blockwise"), SHAPE, None),  # blocks of 10: a scatter
    (compressors.top_k(count=16384, method="blockwise"), SHAPE, None),  # blocks of 8: a mask
    (compressors.top_k(0.02, method="blockwise", block_size=64), SHAPE, None),  # select per block
    (compressors.top_k(0.1, per_sample=True, method="blockwise"), SHAPE, None),
    (compressors.top_k(0.6), (16, 24), (0.6, False)),  # most entries kept: kept signed zeros
    (compressors.rand_k(0.1), SHAPE, None),  # the psum path
]
#: the decay-0.5 residual's dtype per codec (float32 if not named): a bfloat16 residual on the
#: select's large path in place of a program of its own (its select compiles in seconds)
DECAYED_DTYPE = {"top_k(0.01, exact)": jnp.bfloat16}
assert set(DECAYED_DTYPE) <= {codec.name for codec, *_ in CASES}, "a renamed codec: no bf16 run"


EDGES = np.array([np.nan, np.inf, -np.inf, 1e6, -1e6, 1e-10, -1e-10], np.float32)


def _inputs(signals, shape):
    """``x`` and a memory ``[W, *shape]`` with every edge value on both workers: the shared
    edges and signed zeros (``signals.edge_inputs``), a tie, and NaN/inf in the memory."""
    x, mem, positions = signals.edge_inputs(np.random.default_rng(11), shape, EDGES, W)
    flat_x, flat_m = x.reshape(W, -1), mem.reshape(W, -1)
    n = flat_x.shape[1]
    for w, pos in enumerate(positions):
        flat_x[w, pos[n // 4 : n // 4 + n // 16]] = 2.5  # a tie larger than most entries
        flat_m[w, pos[n // 4 : n // 4 + n // 16]] = 0.0
        flat_m[w, pos[-3:]] = [np.nan, np.inf, -0.0]
        flat_x[w, pos[-3:]] = [1.0, -np.inf, +0.0]  # inf - inf: NaN in c
    return x, mem


def _exact_round_trip(c, fraction, per_sample, stable_top, decode_values=None):
    """``D(C(c))`` of exact TopK in numpy: the K entries of largest magnitude (NaN above inf,
    the lowest index on ties: ``stable_top``, test_sparse.py's reference) kept, zeros elsewhere.
    ``decode_values``: a composition's inner round trip of the kept values ``[rows, K]``."""
    rows = c.reshape(c.shape[0], -1) if per_sample else c.reshape(1, -1)
    idx = stable_top(rows, compressors.kept_count(rows.shape[1], fraction, None))
    kept = np.take_along_axis(rows, idx, -1)
    out = np.zeros_like(rows)
    np.put_along_axis(out, idx, kept if decode_values is None else decode_values(kept), -1)
    return out.reshape(c.shape)


def _bits(a):
    """Bit patterns of a float32 array, every NaN mapped to one pattern."""
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


def _assert_bits(got, want, what):
    got_b, want_b = _bits(got), _bits(want)
    bad = np.flatnonzero(got_b != want_b)
    assert bad.size == 0, (
        f"{what}: {bad.size} entries differ, e.g. at {bad[:5]}: got "
        f"{np.asarray(got).reshape(-1)[bad[:5]]} want {np.asarray(want).reshape(-1)[bad[:5]]}"
    )


def _program(codec, mesh, like, decayed_dtype=None):
    """Jitted ``(x, e, g, key) -> (EF mean, e', EF decay 0.5 mean, e', EF21 mean, g')`` on W
    workers; the decay-0.5 residual in ``decayed_dtype`` (``e`` cast to it)."""
    channels = [
        feedback.error_feedback(codec),
        feedback.error_feedback(codec, decay=0.5, residual_dtype=decayed_dtype),
        feedback.ef21(codec),
    ]
    protocols = [comm.plan_reduce(ch, like, min_compression_rate=0) for ch in channels]

    def body(x, e, g, key):
        x, e, g = x[0], e[0], g[0]
        outs = []
        for protocol in protocols:
            state = protocol.init(x, W)
            if isinstance(state.memory, feedback.ErrorFeedbackMemory):
                e_w = e[None].astype(state.memory.residual.value.dtype)
                memory = feedback.ErrorFeedbackMemory(compressors.PerWorker(e_w))
            else:
                g_mean = jax.lax.pmean(g, comm.DATA)
                memory = feedback.EF21Memory(compressors.PerWorker(g[None]), g_mean)
            state = state._replace(memory=memory)
            mean, _, state = comm.compressed_pmean(x, protocol, state, key, comm.DATA)
            kept = getattr(state.memory, "residual", None) or state.memory.estimate
            outs += [mean, kept.value]
        return tuple(outs)

    data = P(comm.DATA)
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(data, data, data, P()),
            out_specs=(P(), data) * len(protocols),
        )
    )


@jax.jit
def _pair_mean(a):
    """``(a[0] + a[1]) / W`` as a program rounds it (one program per shape for the module)."""
    return (a[0] + a[1]) / W


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


@pytest.mark.slow
@pytest.mark.parametrize("codec,shape,exact", CASES, ids=[c.name for c, *_ in CASES])
def test_error_feedback_and_ef21_reductions_keep_their_formulas_bit_for_bit(
    mesh, signals, load_test_module, codec, shape, exact
):
    x, e = _inputs(signals, shape)
    g = e[::-1].copy()  # another memory for EF21
    key = jax.random.key(5)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(comm.DATA)))  # noqa: E731
    half = DECAYED_DTYPE.get(codec.name)
    outs = _program(codec, mesh, jax.ShapeDtypeStruct(shape, jnp.float32), half)(
        put(x), put(e), put(g), key
    )
    ef_mean, ef_e, ef_half_mean, ef_half_e, ef21_mean, ef21_g = (np.asarray(o) for o in outs)

    if exact:
        stable_top = load_test_module("compressors/test_sparse.py")._stable_top
        round_trip = lambda c, k: _exact_round_trip(np.asarray(c), *exact, stable_top)  # noqa: E731
    else:
        round_trip = jax.jit(
            lambda c, k: codec.decompress(codec.compress(c, codec.init(c), k)[0], c)
        )
    k = key if codec.stochastic else None
    with np.errstate(invalid="ignore"):
        c = x + e
        d = np.stack([np.asarray(round_trip(jnp.asarray(c[w]), k)) for w in range(W)])
        zero = np.zeros(shape, np.float32)
        mean = ((zero + d[0]) + d[1]) / np.float32(W)
        _assert_bits(ef_e, c - d, "EF residual")
        if half is None:
            c_half, d_half, mean_half = c, d, mean
        else:  # c = x + f32(e) (e' read back as float32, exactly)
            assert ef_half_e.dtype == half
            c_half = x + e.astype(half).astype(np.float32)
            d_half = np.stack([np.asarray(round_trip(jnp.asarray(c_half[w]), k)) for w in range(W)])
            mean_half = ((zero + d_half[0]) + d_half[1]) / np.float32(W)
        want = (np.float32(0.5) * (c_half - d_half)).astype(ef_half_e.dtype)
        _assert_bits(ef_half_e.astype(np.float32), want.astype(np.float32), "EF e', decay 0.5")
        if codec.reduction is compressors.Reduction.GATHER:
            _assert_bits(ef_mean, mean, "EF mean")
            _assert_bits(ef_half_mean, mean_half, "EF mean, decay 0.5")
        else:  # psum: the values are summed before the decode (a -0.0 sum may stay -0.0)
            np.testing.assert_array_equal(ef_mean, mean)
            np.testing.assert_array_equal(ef_half_mean, mean_half)

        m = x - g
        d = np.stack([np.asarray(round_trip(jnp.asarray(m[w]), k)) for w in range(W)])
        want = g + d
        # the scatter form may keep base's -0.0 where the dense sum gives +0.0: only there
        signed_zero = (want == 0) & (ef21_g == 0)
        _assert_bits(np.where(signed_zero, 0, ef21_g), np.where(signed_zero, 0, want), "EF21 g")
        g_mean = np.asarray(_pair_mean(g))
        want = g_mean + ((zero + d[0]) + d[1]) / np.float32(W)
        np.testing.assert_array_equal(ef21_mean, want)  # pmean's own rounding: values only
    assert np.isnan(ef_e).any() and np.isinf(x).any()  # the edges reached the reduction
    assert np.any(_bits(ef_e) == _bits(np.float32(-0.0)))  # unkept -0.0 residuals exist
