"""plan_reduce/compressed_pmean: every path's mean, its HLO bytes against wire_bytes, the policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp.comm import _reduce

pytestmark = pytest.mark.usefixtures("fast_compiles")

W = 4
SHAPE = (64, 32)


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])


@pytest.fixture(scope="module")
def grads(mesh):
    g = np.random.default_rng(0).standard_normal((W, *SHAPE)).astype(np.float32)
    return g, jax.device_put(g, NamedSharding(mesh, P(comm.DATA)))


def reducer(channel, path, mesh, axis=comm.DATA):
    """Jitted ``g[W, ...] -> (mean, echo[W, ...], bytes)`` for one fresh state."""

    def body(x):
        x = x[0]
        protocol = comm.plan_reduce(channel, x, path=path, min_compression_rate=0)
        state = protocol.init(x, W)
        mean, echo, _ = comm.compressed_pmean(x, protocol, state, jax.random.key(1), axis)
        sent = protocol.wire_bytes(x, W)
        return mean, echo[None], jnp.float32(sent)

    out = (P(), P(comm.DATA), P())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(comm.DATA), out_specs=out))


CASES = [
    (compressors.rand_k(0.25), "psum"),
    (compressors.top_k(0.1), "all_gather"),
    (compressors.quantize(8), "all_gather"),
    (compressors.sign(), "all_gather"),
    (compressors.compose(compressors.top_k(0.1), compressors.quantize(8)), "all_gather"),
    (compressors.quantize(8), "two_phase"),
    (compressors.top_k(0.1), "two_phase"),
    (compressors.cast("bfloat16"), "two_phase"),
    (compressors.power_sgd(2), "codec"),
    (feedback.error_feedback(compressors.power_sgd(2)), "codec"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("channel", "path"), CASES, ids=lambda c: getattr(c, "name", c))
def test_hlo_bytes_equal_reduce_bytes_and_no_dense_all_reduce(mesh, grads, channel, path):
    _, g = grads
    fn = reducer(channel, path, mesh)
    report = comm.measure_collectives(fn, g)
    _, _, sent = fn(g)
    assert report.total_bytes == float(sent)
    assert report.total_bytes < np.prod(SHAPE) * 4 * 0.65
    assert all("f32[64,32]" not in r.shape for r in report.records), report.table()


@pytest.mark.parametrize("path", ["psum", "all_gather", "two_phase"])
def test_identity_codec_gives_the_exact_mean_on_every_path(mesh, grads, path):
    g_np, g = grads
    mean, echo, _ = reducer(compressors.identity(), path, mesh)(g)
    np.testing.assert_allclose(np.asarray(mean), g_np.mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(echo), g_np)


@pytest.mark.parametrize("path", ["all_gather", "two_phase"])
def test_quantized_mean_is_within_the_quantization_error(mesh, grads, path):
    g_np, g = grads
    mean, echo, _ = reducer(compressors.quantize(8), path, mesh)(g)
    step = np.abs(g_np).max() / 128  # one 8-bit level of the largest scale
    hops = 2 if path == "two_phase" else 1  # the server re-quantizes once more
    assert np.abs(np.asarray(mean) - g_np.mean(0)).max() <= hops * step
    assert np.abs(np.asarray(echo) - g_np).max() <= step


def test_rand_k_workers_share_positions_and_psum_values(mesh, grads):
    g_np, g = grads
    codec = compressors.rand_k(count=100)
    mean, echo, _ = reducer(codec, "psum", mesh)(g)
    echo = np.asarray(echo)
    kept = echo[0] != 0
    assert kept.sum() == 100
    assert all(np.array_equal(e != 0, kept) for e in echo)  # one shared seed
    np.testing.assert_allclose(np.asarray(mean), echo.mean(0), rtol=1e-6)


def test_cast_psum_is_widened_by_the_cpu_backend(mesh, grads):
    """Documents JAX-NOTES §2: a 16-bit psum travels as f32 in CPU HLO; two_phase stays u16."""
    _, g = grads
    psum = comm.measure_collectives(reducer(compressors.cast(), "psum", mesh), g)
    two = comm.measure_collectives(reducer(compressors.cast(), "two_phase", mesh), g)
    if jax.default_backend() == "cpu":
        assert psum.dtypes("all-reduce") == {"f32"}
        assert psum.total_bytes == np.prod(SHAPE) * 4
    else:
        assert psum.total_bytes == np.prod(SHAPE) * 2
    assert two.dtypes() == {"u16"}


def test_low_rank_on_one_worker_equals_the_codec_with_its_epsilon_and_decay(grads):
    x = jnp.asarray(grads[0][0])
    codec = compressors.power_sgd(2, epsilon=1.0)  # far from the default 1e-8: it shows
    channel = feedback.error_feedback(codec, decay=0.5)
    default = compressors.power_sgd(2)

    @jax.jit
    def run(x):
        protocol = comm.plan_reduce(channel, x)
        mean, _, state = comm.compressed_pmean(x, protocol, protocol.init(x, None), None, None)
        payload, codec_state = codec.compress(x, codec.init(x), None)
        other = default.decompress(default.compress(x, default.init(x), None)[0], x)
        return mean, state, codec.decompress(payload, x), codec_state, other

    mean, state, want, codec_state, other = run(x)
    np.testing.assert_allclose(mean, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.inner.q.q, codec_state.q, rtol=1e-5, atol=1e-6)
    residual = state.memory.residual.value[0]
    np.testing.assert_allclose(residual, 0.5 * (x - want), rtol=1e-5, atol=1e-6)
    assert not np.allclose(mean, other, rtol=1e-3)


DECODE_CODECS = [
    (compressors.top_k(0.1), (6, 10), jnp.float32),
    (compressors.top_k(0.3, per_sample=True), (6, 10), jnp.bfloat16),
    (compressors.top_k(0.2, method="blockwise"), (37, 3), jnp.float32),
    (compressors.top_k(count=5, method="blockwise", block_size=8), (50,), jnp.float32),
    (compressors.quantize(4), (5, 7), jnp.bfloat16),
    (compressors.quantize(2, scale="minmax"), (5, 7), jnp.float32),
    (compressors.quantize(8, scale="feature"), (4, 6), jnp.float32),
    (compressors.sign(), (13,), jnp.float32),
    (compressors.compose(compressors.top_k(0.25), compressors.quantize(8)), (6, 10), jnp.float32),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("codec", "shape", "dtype"),
    DECODE_CODECS,
    ids=[f"{c.name}-{np.dtype(d).name}" for c, _, d in DECODE_CODECS],
)
def test_fused_decode_mean_equals_the_mean_of_each_decoded_payload(codec, shape, dtype):
    """19 payloads: two fused chunks of 8 in a loop and a rest of 3."""
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((19, *shape)), dtype)
    like = jax.ShapeDtypeStruct(shape, dtype)

    @jax.jit
    def run(xs):
        stacked = jax.vmap(lambda x: codec.compress(x, codec.init(x), None)[0])(xs)
        each = jax.vmap(lambda p: codec.decompress(p, like))(stacked)  # one by one
        return _reduce.decode_mean(codec, stacked, like), each

    got, each = run(xs)
    want = np.asarray(each, np.float32).mean(0)
    assert got.dtype == dtype
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_two_phase_bytes_per_worker_stay_flat_while_all_gather_traffic_grows():
    """Measured from HLO at 2, 4 and 8 workers (quantize(8) on 4096 floats)."""
    codec = compressors.quantize(8)
    sent, received = {}, {}
    for workers in (2, 4, 8):
        mesh = comm.make_mesh([(comm.DATA, workers)], devices=jax.devices()[:workers])
        for path in ("two_phase", "all_gather"):

            def body(x, path=path, workers=workers):
                protocol = comm.plan_reduce(codec, x, path=path, min_ndim=1)
                state = protocol.init(x, workers)
                mean, _, _ = comm.compressed_pmean(x, protocol, state, None, comm.DATA)
                return mean, jnp.float32(protocol.wire_bytes(x, workers))

            fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P(), P())))
            report = comm.measure_collectives(fn, jnp.ones(4096))
            assert report.total_bytes == float(fn(jnp.ones(4096))[1])
            sent[path, workers] = report.total_bytes
            received[path, workers] = sum(  # ring all-gather / pairwise all-to-all
                r.total_bytes * ((workers - 1) if r.kind == "all-gather" else 1 - 1 / workers)
                for r in report.records
            )
    # two-phase: (W + 1) chunks of n / W bytes (+ a scale each), n (1 + 1/W) <= 1.5 n
    assert sent["two_phase", 2] >= sent["two_phase", 4] >= sent["two_phase", 8] > 4096
    assert sent["two_phase", 2] <= 1.5 * 4096 + 3 * 4
    assert received["two_phase", 8] < 2 * 4096 + 64
    # all-gather: every worker receives the W - 1 other payloads
    for w in (2, 4, 8):
        assert received["all_gather", w] == (w - 1) * (4096 + 4)


def test_policy_falls_back_to_dense_with_reasons(caplog):
    f32 = jnp.float32
    cases = [
        (compressors.power_sgd(2), (16,), 2, "1-D"),
        (compressors.top_k(0.99), (64, 64), 2, "compresses"),
        (compressors.quantize(8, scale="feature", axes=(4,)), (8, 8), 2, "cannot compress"),
    ]
    for codec, shape, ndim, reason in cases:
        path, why = comm.plan_path(codec, jax.ShapeDtypeStruct(shape, f32), min_ndim=ndim)
        assert path == "dense" and reason in why
    with caplog.at_level("INFO", logger="jaxcomp.comm._reduce_plan"):
        protocol = comm.plan_reduce(compressors.top_k(0.99), jnp.zeros((64, 64)), name="w")
    assert isinstance(protocol.init(jnp.zeros((64, 64)), None), comm.DenseReduce)
    assert "w: averaged uncompressed" in caplog.text
    path, _ = comm.plan_path(compressors.top_k(0.99), jax.ShapeDtypeStruct((64, 64), f32),
                             min_compression_rate=0)  # fmt: skip
    assert path == "all_gather"


def test_stochastic_codec_needs_a_key_and_ef21_needs_a_gather_path():
    x = jnp.ones((8, 8))
    protocol = comm.plan_reduce(compressors.rand_k(0.5), x, min_compression_rate=0)
    with pytest.raises(ValueError, match="PRNG key"):
        comm.compressed_pmean(x, protocol, protocol.init(x, None), None, None)
    with pytest.raises(ValueError, match="EF21"):
        comm.plan_reduce(feedback.ef21(compressors.quantize(8)), x, path="two_phase")
