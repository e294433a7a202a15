"""Error feedback around reductions whose echo is dense keeps its formula bit for bit.

``test_reduction_bits`` covers TopK (an in-place scatter into the residual) and RandK. Here
the other forms: codecs without ``Codec.add_decoded`` (quantize on the ``all_gather`` path),
where error feedback forms ``c - echo`` itself, and PowerSGD's own protocol, whose echo is the
averaged reconstruction ``P Q'^T``. On 2 workers, compared as bit patterns (every NaN one):

* ``e' = decay * (c - echo)`` with ``c = x + e``, bit for bit where the echo is a sum
  (PowerSGD of rank >= 2); where it is one product (rank 1: ``c - p q``; quantize:
  ``c - code * scale``) XLA:CPU forms it as one fused multiply-add, so there to half an ulp of
  the product, zeros, infinities and NaNs exactly (main's code does the same);
* PowerSGD: ``echo`` is the mean, and the mean is the plain protocol's on ``c`` (the same
  program without error feedback, run on ``x + e``);
* quantize: ``echo = D(C(c))`` of the codec's round trip.

Inputs hold -0.0 in ``x`` and in the residual, magnitudes 1e-10 .. 1e6, an all-zero matrix
(``c = -0.0`` everywhere: rank 0), a rank-deficient one, NaN/inf on one worker (every entry of
PowerSGD's mean is then NaN) and a 1-D leaf (averaged dense, no compensation).

The contract: ``compensate`` tells ``Feedback.reduce`` explicitly whether the wrapped
protocol adds the echo in place (``in_place``); the generic paths offer that
(``all_reduce_into``) only for codecs with ``Codec.add_decoded``.
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

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

W = 2
SHAPE = (96, 160)


def _assert_bits(got, want, what):
    """Equal as float32 bit patterns, every NaN counted as one pattern."""
    got, want = (np.asarray(a, np.float32) for a in (got, want))
    got, want = (np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32) for a in (got, want))
    np.testing.assert_array_equal(got, want, err_msg=what)


def _assert_fused(got, want, product, decay, what):
    """``got`` is ``want = decay * (c - product)`` bit for bit, except where XLA:CPU formed
    ``c - a * b`` as one fused multiply-add (one rounding, where ``want`` rounds the product
    first): there within half an ulp of the product (plus one of the result). NaNs and
    signed zeros of ``want`` are kept exactly."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=what)
    exact = (want == 0) | ~np.isfinite(want)
    _assert_bits(got[exact], want[exact], what + " (zeros, inf, NaN)")
    tol = np.float32(decay) * np.spacing(np.abs(product)) / 2 + np.spacing(np.abs(want))
    off = np.flatnonzero(~exact & (np.abs(got - want) > tol))
    assert off.size == 0, (
        f"{what}: {off.size} entries beyond one fused rounding, e.g. got "
        f"{got.reshape(-1)[off[:5]]} want {want.reshape(-1)[off[:5]]}"
    )


def _inputs(signals, kind, shape):
    """``x``, ``e`` of ``[W, *shape]``: random with edge values (no NaN/inf: PowerSGD spreads
    them over the whole mean), or the named special case."""
    rng = np.random.default_rng(3)
    edges = np.array([1e6, -1e6, 1e-10, -1e-10], np.float32)
    x, e, _ = signals.edge_inputs(rng, shape, edges, W)
    fx = x.reshape(W, -1)
    if kind == "scaled":
        x *= np.float32(1e-10)
        e *= np.float32(1e-10)
    elif kind == "zero":  # c = -0.0 + -0.0 everywhere: a rank-0 matrix
        x[:] = -0.0
        e[:] = -0.0
    elif kind == "rank1":
        u = rng.standard_normal((W, shape[0], 1)).astype(np.float32)
        v = rng.standard_normal((W, 1, int(np.prod(shape[1:])))).astype(np.float32)
        x = (u * v).reshape(W, *shape)
        e = np.zeros_like(x)
    elif kind == "nonfinite":
        fx[1, 7], fx[1, 9] = np.nan, np.inf
    return x, e


def _program(channel, mesh, like, with_memory=True):
    """Jitted ``(x, e) -> (mean, e')`` of ``channel``'s reduction on W workers."""
    protocol = comm.plan_reduce(channel, like, min_compression_rate=0, min_ndim=1, quiet=True)

    def body(x, e):
        x, e = x[0], e[0]
        state = protocol.init(x, W)
        if with_memory:
            memory = feedback.ErrorFeedbackMemory(compressors.PerWorker(e[None]))
            state = state._replace(memory=memory)
        mean, _, state = comm.compressed_pmean(x, protocol, state, None, comm.DATA)
        kept = state.memory.residual.value if with_memory else x[None]
        return mean, kept

    data = P(comm.DATA)
    spec = jax.shard_map(body, mesh=mesh, in_specs=(data, data), out_specs=(P(), data))
    return jax.jit(spec)


@functools.cache
def _power_sgd_programs(mesh, shape, rank, decay):
    """PowerSGD's error-feedback program and its plain protocol's: one pair per shape, rank and
    decay, shared by the inputs that differ in values only."""
    codec = compressors.power_sgd(rank)
    like = jax.ShapeDtypeStruct(shape, jnp.float32)
    ef = _program(feedback.error_feedback(codec, decay=decay), mesh, like)
    return ef, _program(codec, mesh, like, with_memory=False)


@functools.cache
def _dense_echo_program(mesh, codec, decay):
    """``codec``'s error-feedback program on ``SHAPE``, shared by the inputs."""
    return _program(
        feedback.error_feedback(codec, decay=decay), mesh, jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    )


@functools.cache
def _round_trip(codec):
    return jax.jit(lambda c: compressors.compress_and_decode(codec, c, codec.init(c))[2])


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


def _put(mesh, a):
    return jax.device_put(a, NamedSharding(mesh, P(comm.DATA)))


POWER_SGD_CASES = [
    ("random", SHAPE, 2, 1.0),
    ("random", SHAPE, 1, 0.5),
    ("random", (4, 24, 40), 3, 1.0),  # a 3-D kernel: matrix view (96, 40)
    ("scaled", SHAPE, 2, 1.0),
    ("zero", SHAPE, 2, 1.0),
    ("rank1", SHAPE, 2, 1.0),  # a dead column of P; the rank-2 programs of the rows above
    ("nonfinite", SHAPE, 2, 1.0),
    ("random", (300,), 2, 1.0),  # 1-D: averaged dense by the protocol
]


@pytest.mark.user_numerics
@pytest.mark.slow
@pytest.mark.parametrize("kind,shape,rank,decay", POWER_SGD_CASES, ids=str)
def test_power_sgd_error_feedback_keeps_c_minus_its_mean_bit_for_bit(
    mesh, signals, kind, shape, rank, decay
):
    x, e = _inputs(signals, kind, shape)
    ef, plain = _power_sgd_programs(mesh, shape, rank, decay)
    mean, e_new = (np.asarray(o) for o in ef(_put(mesh, x), _put(mesh, e)))
    with np.errstate(invalid="ignore", over="ignore"):
        c = x + e
        want_mean, _ = (np.asarray(o) for o in plain(_put(mesh, c), _put(mesh, c)))
        _assert_bits(mean, want_mean, "mean (the plain protocol's on x + e)")
        echo = mean[None] if len(shape) > 1 else c  # 1-D: averaged dense, the echo is c
        residual = c - echo
        if decay != 1.0:
            residual = np.float32(decay) * residual
        if rank > 1 or len(shape) < 2:
            _assert_bits(e_new, residual, "EF residual")
        else:  # c - p * q: one fused multiply-add
            _assert_fused(e_new, residual, echo, decay, "EF residual")
    if kind == "zero":
        assert np.all(np.signbit(e_new) & (e_new == 0))  # -0.0 - +0.0 stays -0.0
    if kind == "nonfinite":
        assert np.isnan(mean).all() and np.isnan(e_new).all()


QUANTIZE_CASES = [
    compressors.quantize(8),
    compressors.quantize(4, scale="feature"),
    compressors.sign(),
]


@pytest.mark.user_numerics
@pytest.mark.slow
@pytest.mark.parametrize("codec", QUANTIZE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("kind", ["random", "zero", "nonfinite"])
def test_dense_echo_error_feedback_keeps_c_minus_the_round_trip_bit_for_bit(
    mesh, signals, codec, kind
):
    x, e = _inputs(signals, kind, SHAPE)
    for decay in (1.0, 0.5):
        ef, round_trip = _dense_echo_program(mesh, codec, decay), _round_trip(codec)
        _, e_new = (np.asarray(o) for o in ef(_put(mesh, x), _put(mesh, e)))
        with np.errstate(invalid="ignore"):
            c = x + e
            d = np.stack([np.asarray(round_trip(jnp.asarray(c[w]))) for w in range(W)])
            residual = c - d if decay == 1.0 else np.float32(decay) * (c - d)
        _assert_fused(e_new, residual, d, decay, f"EF residual, decay {decay}")


IN_PLACE_CODECS = [compressors.top_k(0.1), compressors.top_k(0.1, method="blockwise")]
DENSE_ECHO_CODECS = [compressors.quantize(8), compressors.sign(), compressors.identity()]


@pytest.mark.parametrize("codec", IN_PLACE_CODECS + DENSE_ECHO_CODECS, ids=lambda c: c.name)
def test_generic_paths_add_in_place_only_for_codecs_with_an_in_place_decode(codec):
    has = codec.add_decoded is not None
    assert (comm.gather_protocol(codec).all_reduce_into is not None) == has
    assert codec in IN_PLACE_CODECS if has else codec in DENSE_ECHO_CODECS
    for summable in (compressors.rand_k(0.1), compressors.identity()):
        assert comm.psum_protocol(summable).all_reduce_into is None


def _recording(inner):
    """``inner`` (a Feedback) whose ``reduce`` records the ``in_place`` it is handed."""
    seen = []

    def reduce(x, memory, run, axis_name, in_place=False):
        seen.append(in_place)
        return inner.reduce(x, memory, run, axis_name, in_place=in_place)

    return inner._replace(reduce=reduce), seen


@pytest.mark.slow
@pytest.mark.parametrize(
    "protocol,in_place",
    [
        (comm.gather_protocol(compressors.top_k(0.1)), True),
        (comm.gather_protocol(compressors.quantize(8)), False),
        (comm.psum_protocol(compressors.rand_k(0.1)), False),
        (compressors.power_sgd(2).protocol, False),
        (comm.dense_protocol(), False),
    ],
    ids=lambda v: getattr(v, "name", v),
)
def test_compensate_hands_down_whether_the_protocol_adds_in_place(protocol, in_place):
    recorded = [
        _recording(f) for f in (feedback.error_feedback_reduction(), feedback.ef21_reduction())
    ]
    wrapped = [feedback.compensate(protocol, fb) for fb, _ in recorded]

    @jax.jit  # one program for both (eagerly each operation compiled alone: 20-74 a case)
    def means(x):
        return [w.all_reduce(x, w.init(x, None), jax.random.key(0), None)[0] for w in wrapped]

    out = means(np.linspace(-1.0, 1.0, 64 * 48, dtype=np.float32).reshape(64, 48))
    assert [seen for _, seen in recorded] == [[in_place], [in_place]]  # one trace each
    assert all(np.isfinite(np.asarray(mean)).all() for mean in out)
