"""EF and EF21 around a 2-worker reduction equal their reference formulas, bit for bit.

The reductions fuse the residual (or the estimate) with the codec's decode; whatever they
fuse, what they keep must be exactly the formula computed the slow way, one worker at a time,
from ``codec.compress`` and ``codec.decompress``:

* EF:   ``c = x + e``, ``e' = c - D(C(c))``, mean = mean over workers of ``D(C(c_w))``;
* EF21: ``m = x - g``, ``g' = g + D(C(m))``, ``G' = G + mean_w D(C(m_w))``, output ``G'``;
* PowerSGD's own protocol: ``e' = c - mean`` (the reference keeps the averaged reconstruction).

The quantizer and PowerSGD run on a shape large enough for the codecs' fast paths; the
composition TopK -> quantize on a small one (8192 entries: ``lax.top_k``'s select; what it adds
is the quantized values decoded, then scattered, on every path alike). Worker 0 holds a NaN and
a -inf. The TopK codecs alone, exact TopK's sort-free select on 131072 entries among them, and a
bfloat16 residual on its in-place path: test_reduction_bits.py (bit patterns).

TopK's decode is a select or a scatter (also of quantized values, composed), so every value is
bit-identical. A quantizer's decode alone is a product ``a * s``; fused into ``c - a * s`` (or
``d0 + a * s``) XLA:CPU contracts it into one FMA, which rounds once where the two-step
reference rounds twice: there the values may differ by one unit in the last place of the
operands' sum (non-finite exactly where the reference is).
"""

import functools

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
SHAPE = (256, 512)  # 131072 entries: the quantizer's and PowerSGD's
#: the composition's: its select is exact TopK's (the bracketed one on SHAPE, seconds to compile
#: per program; pinned there by test_reduction_bits.py), its decode the quantizer's on the values
SMALL = (128, 64)

#: the codecs whose decode is not a select (the TopK codecs alone, exact, blockwise of 100 and
#: of 64, take the same formulas bit for bit, signed zeros too, in test_reduction_bits.py, on
#: these shapes with NaN and infinities on both workers: not repeated here)
FRACTION = 0.01
TOP_K = compressors.top_k(FRACTION)
QUANTIZE = compressors.quantize(8)
COMPOSED = compressors.compose(TOP_K, QUANTIZE)  # no round trip
CODECS = [QUANTIZE, COMPOSED]


#: the quantizer in the fast tier, the composition in the slow
CODEC_PARAMS = [
    pytest.param(c, id=c.name, marks=() if c.name.startswith("quantize") else pytest.mark.slow)
    for c in CODECS
]
POWER_SGD = compressors.power_sgd(2)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def _inputs(nonfinite, codec=None):
    shape = SMALL if codec is COMPOSED else SHAPE
    rng = np.random.default_rng(7)
    x = rng.standard_normal((W, *shape)).astype(np.float32)
    mem = (0.5 * rng.standard_normal((W, *shape))).astype(np.float32)
    if nonfinite:
        x[0, 3, 5] = np.nan
        x[0, 100, 7] = -np.inf
    return x, mem


def _step(channel, mesh):
    """Jitted ``(x[W, ...], memory[W, ...]) -> (mean, memory'[W, ...])`` of one reduction,
    with the memory (EF's residual, EF21's estimate; EF21's mean estimate is the mean of the
    workers' estimates) set from ``memory``."""

    def body(x, mem):
        x, mem = x[0], mem[0]
        protocol = comm.plan_reduce(channel, x, min_compression_rate=0)
        state = protocol.init(x, W)
        per_worker = compressors.PerWorker(mem[None])
        if isinstance(state.memory, feedback.ErrorFeedbackMemory):
            memory = feedback.ErrorFeedbackMemory(per_worker)
            read = lambda m: m.residual.value  # noqa: E731
        else:
            memory = feedback.EF21Memory(per_worker, jax.lax.pmean(mem, comm.DATA))
            read = lambda m: m.estimate.value  # noqa: E731
        state = state._replace(memory=memory)
        mean, _, state = comm.compressed_pmean(x, protocol, state, None, comm.DATA)
        return mean, read(state.memory)

    specs = (P(comm.DATA), P(comm.DATA))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P(comm.DATA))))


@functools.cache
def _feedback_step(kind, codec, mesh):
    """:func:`_step` of ``feedback.<kind>(codec)``, compiled once for the module's inputs."""
    return _step(getattr(feedback, kind)(codec), mesh)


@functools.cache
def _compress_and_decompress(codec):
    """The codec's compress and decompress, each a program of its own (as a sender's and a
    receiver's), compiled once per input shape."""
    return jax.jit(lambda c: codec.compress(c, codec.init(c), None)[0]), jax.jit(codec.decompress)


def _round_trip(codec, c, load_test_module):
    """``D(C(c))`` the slow way: compress, then decompress the payload. The composition's is
    numpy's exact TopK (test_reduction_bits' ``_exact_round_trip``: the select's programs take
    seconds to compile, and that file pins them to it) around the quantizer's own programs on
    the kept values (``compose`` decodes the values, then scatters them)."""
    if codec is not COMPOSED:
        compress, decompress = _compress_and_decompress(codec)
        return np.asarray(decompress(compress(c), c))
    like = compressors.payload_shape(TOP_K, jax.ShapeDtypeStruct(c.shape, c.dtype)).values
    compress, decompress = _compress_and_decompress(QUANTIZE)

    def quantized(kept):
        values = jnp.asarray(kept.reshape(like.shape))
        return np.asarray(decompress(compress(values), values)).reshape(kept.shape)

    stable_top = load_test_module("compressors/test_sparse.py")._stable_top
    bits = load_test_module("feedback/test_reduction_bits.py")
    return bits._exact_round_trip(np.asarray(c), FRACTION, False, stable_top, quantized)


def _assert_formula(codec, got, want, *operands):
    """``got == want`` bit for bit; for a quantizer within one ulp of the operands' sum."""
    got = np.asarray(got)
    if not codec.name.startswith("quantize"):
        np.testing.assert_array_equal(got, want)
        return
    # non-finite exactly where the reference is (which of NaN/inf may differ: the quantizer's
    # round trip decodes a NaN code as NaN, its packed payload as a clipped code times inf)
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    ulp = np.spacing(np.sum([np.abs(o) for o in operands], axis=0))
    assert np.all(np.abs(got - want)[finite] <= ulp[finite]), np.max(np.abs(got - want)[finite])


@jax.jit
def _pair_mean(a):
    """``(a[0] + a[1]) / W`` as a program rounds it (one program for the module)."""
    return (a[0] + a[1]) / W


def _put(mesh, a):
    return jax.device_put(a, NamedSharding(mesh, P(comm.DATA)))


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("codec", CODEC_PARAMS)
def test_error_feedback_reduction_is_the_reference_formula(
    mesh, load_test_module, codec, nonfinite
):
    x, e = _inputs(nonfinite, codec)
    mean, e_new = _feedback_step("error_feedback", codec, mesh)(_put(mesh, x), _put(mesh, e))
    c = x + e
    decoded = [_round_trip(codec, jnp.asarray(c[w]), load_test_module) for w in range(W)]
    d = np.stack(decoded)
    _assert_formula(codec, e_new, c - d, c, d)
    _assert_formula(codec, mean, (d[0] + d[1]) / W, d[0] / W, d[1] / W)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan_inf"])
@pytest.mark.parametrize("codec", CODEC_PARAMS)
def test_ef21_reduction_is_the_reference_formula(mesh, load_test_module, codec, nonfinite):
    x, g = _inputs(nonfinite, codec)
    mean, g_new = _feedback_step("ef21", codec, mesh)(_put(mesh, x), _put(mesh, g))
    decoded = [_round_trip(codec, jnp.asarray(x[w] - g[w]), load_test_module) for w in range(W)]
    d = np.stack(decoded)
    _assert_formula(codec, g_new, g + d, g, d)
    g_mean = np.asarray(_pair_mean(g))  # G: pmean's own rounding
    want = g_mean + (d[0] + d[1]) / W
    _assert_formula(codec, mean, want, g_mean, d[0] / W, d[1] / W, want)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan_inf"])
def test_power_sgd_error_feedback_keeps_the_input_minus_the_averaged_reconstruction(
    mesh, nonfinite
):
    x, e = _inputs(nonfinite)
    mean, e_new = _feedback_step("error_feedback", POWER_SGD, mesh)(_put(mesh, x), _put(mesh, e))
    c = x + e
    want = np.stack([c[w] - np.asarray(mean) for w in range(W)])
    np.testing.assert_array_equal(np.asarray(e_new), want)
    if not nonfinite:  # the reconstruction is a rank-2 approximation of the mean of c
        np.testing.assert_allclose(np.linalg.matrix_rank(np.asarray(mean)), 2)
