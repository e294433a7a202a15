"""Error-feedback channels: telescoping identity, EF21/AQ-SGD mirrors, per-sample buffers."""

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback

pytestmark = pytest.mark.usefixtures("fast_compiles")

KEY = jax.random.key(0)
TOPK = compressors.top_k(0.25)
Q4 = compressors.quantize(4, scale="feature")


def _ef_step(channel):
    @jax.jit
    def step(x, send_state, recv_state, key):
        payload, new_send = channel.send(x, send_state, key)
        x_hat, new_recv = channel.receive(payload, recv_state, x)
        return x_hat, new_send, new_recv

    return step


EF_STEPS = {
    name: _ef_step(feedback.error_feedback(codec))
    for name, codec in [("topk", TOPK), ("q4", Q4), ("sign", compressors.sign())]
}


@given(
    x=hnp.arrays(np.float32, (8, 6), elements=st.floats(-50, 50, width=32)),
    e=hnp.arrays(np.float32, (8, 6), elements=st.floats(-5, 5, width=32)),
    codec=st.sampled_from(sorted(EF_STEPS)),
)
def test_error_feedback_telescopes(x, e, codec):
    state = feedback.ErrorFeedbackState(jnp.asarray(e), compressors.EmptyState())
    x_hat, new_state, _ = EF_STEPS[codec](jnp.asarray(x), state, compressors.EmptyState(), KEY)
    # x + e_old == x_hat + e_new
    np.testing.assert_allclose(
        x + e, np.asarray(x_hat) + np.asarray(new_state.residual), rtol=1e-6, atol=1e-4
    )


def _normal(seed, shape):
    """float32 standard normal test data from numpy: an eager ``jax.random.normal`` compiles a
    program per shape (~1 s each at these shapes)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_error_feedback_sum_of_received_tracks_sum_of_sent():
    channel = feedback.error_feedback(TOPK)
    step = EF_STEPS["topk"]
    xs = _normal(0, (50, 8, 6))
    send, recv = channel.init(xs[0])
    received = jnp.zeros((8, 6))
    for x in xs:
        x_hat, send, recv = step(x, send, recv, KEY)
        received = received + x_hat
    np.testing.assert_allclose(received + send.residual, xs.sum(0), rtol=1e-5, atol=1e-4)


def test_error_feedback_per_sample_buffers_follow_ids():
    channel = feedback.error_feedback(compressors.top_k(count=1, per_sample=True), num_samples=5)
    x = jnp.array([[1.0, 0.5], [2.0, -0.25]])
    send, _ = channel.init(x)
    assert send.residual.shape == (5, 2)
    _, send = channel.send(x, send, ids=jnp.array([3, 1]))
    np.testing.assert_array_equal(send.residual[3], [0.0, 0.5])
    np.testing.assert_array_equal(send.residual[1], [0.0, -0.25])
    np.testing.assert_array_equal(send.residual[jnp.array([0, 2, 4])], 0.0)
    with pytest.raises(ValueError, match="sample ids"):
        channel.send(x, send)


def test_error_feedback_decay():
    channel = feedback.error_feedback(compressors.top_k(count=1), decay=0.5)
    send, _ = channel.init(jnp.zeros(2))
    _, send = channel.send(jnp.array([1.0, 0.5]), send)
    np.testing.assert_array_equal(send.residual, [0.0, 0.25])


@pytest.mark.parametrize("codec", [TOPK, Q4, compressors.rand_k(0.25)], ids=lambda c: c.name)
def test_ef21_mirrors_stay_identical_and_track_the_signal(codec):
    channel = feedback.ef21(codec)
    xs = jnp.cumsum(0.05 * _normal(1, (80, 8, 6)), axis=0) + 1.0  # slowly drifting

    def body(carry, inp):
        send, recv = carry
        x, key = inp
        payload, send = channel.send(x, send, key)
        x_hat, recv = channel.receive(payload, recv, x)
        return (send, recv), (x_hat, send.estimate, recv.estimate)

    keys = jax.random.split(KEY, xs.shape[0])
    _, (x_hat, est_send, est_recv) = jax.jit(lambda c, i: jax.lax.scan(body, c, i))(
        channel.init(xs[0]), (xs, keys)
    )
    np.testing.assert_array_equal(est_send, est_recv)  # bit-identical mirrors at every step
    np.testing.assert_array_equal(x_hat, est_recv)
    err = np.linalg.norm(np.asarray(x_hat[-10:] - xs[-10:])) / np.linalg.norm(np.asarray(xs[-10:]))
    assert err < 0.1


MIRROR_CODECS = {
    "topk": compressors.top_k(0.25, per_sample=True),
    "q2_feature": compressors.quantize(2, scale="feature"),
    "q4_minmax_stochastic": compressors.quantize(4, scale="minmax", rounding="stochastic"),
}


def _mirror_run(codec, num_samples):
    channel = feedback.ef21(codec, num_samples=num_samples) if num_samples else feedback.ef21(codec)

    @jax.jit
    def run(xs, ids, keys):
        def body(carry, inp):
            send, recv = carry
            x, i, k = inp
            payload, send = channel.send(x, send, k, i)
            _, recv = channel.receive(payload, recv, x, i)
            return (send, recv), jnp.max(jnp.abs(send.estimate - recv.estimate))

        _, gaps = jax.lax.scan(body, channel.init(xs[0]), (xs, ids, keys))
        return gaps

    return run


MIRRORS = {(c, n): _mirror_run(MIRROR_CODECS[c], n) for c in MIRROR_CODECS for n in (None, 6)}


#: one program per (codec, per-sample buffers): the fast tier runs the stochastic per-sample one
MIRROR_PARAMS = [
    pytest.param(c, n, marks=() if (c, n) == ("q4_minmax_stochastic", 6) else pytest.mark.slow)
    for c, n in MIRRORS
]


@pytest.mark.parametrize("codec, num_samples", MIRROR_PARAMS)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-3, 1e3))
def test_ef21_and_aq_sgd_mirrors_stay_equal_over_many_steps(codec, num_samples, seed, scale):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    xs = scale * jnp.cumsum(jax.random.normal(k1, (40, 3, 8)), axis=0)
    ids = jax.random.randint(k2, (40, 3), 0, 6)
    gaps = MIRRORS[(codec, num_samples)](xs, ids, jax.random.split(k3, 40))
    assert float(gaps.max()) == 0.0


def test_aq_sgd_warm_up_fills_both_caches_then_deltas_travel():
    num_samples, batch = 10, 4
    channel = feedback.aq_sgd(compressors.quantize(4, scale="feature"), num_samples)
    data = _normal(2, (num_samples, 3, 5))
    send, recv = channel.init(data[:batch])
    assert send.estimate.dtype == jnp.float16 and send.estimate.shape == (num_samples, 3, 5)
    ids = jnp.arange(num_samples).reshape(-1, 2)  # warm-up "epoch" in micro-batches of 2
    for i in ids:
        send = channel.dense_send(data[i], send, i)
        recv = channel.dense_receive(data[i], recv, i)
    np.testing.assert_array_equal(send.estimate, data.astype(jnp.float16))
    np.testing.assert_array_equal(recv.estimate, send.estimate)

    drift = data + 0.01 * _normal(3, data.shape)
    step = jax.jit(lambda x, s, r, i: _aq_step(channel, x, s, r, i))
    for _ in range(3):
        for i in ids[::-1]:
            x_hat, send, recv = step(drift[i], send, recv, i)
            np.testing.assert_array_equal(send.estimate, recv.estimate)
    np.testing.assert_allclose(recv.estimate.astype(jnp.float32), drift, atol=2e-3)
    with pytest.raises(ValueError, match="sample ids"):
        channel.send(data[:2], send)


def _aq_step(channel, x, send, recv, ids):
    payload, send = channel.send(x, send, None, ids)
    x_hat, recv = channel.receive(payload, recv, x, ids)
    return x_hat, send, recv


def test_aq_sgd_ids_shape_is_checked():
    channel = feedback.aq_sgd(TOPK, 8)
    x = jnp.ones((2, 4))
    send, _ = channel.init(x)
    with pytest.raises(ValueError, match="shape"):
        channel.send(x, send, ids=jnp.arange(3))


def test_plain_channel_and_as_channel():
    channel = feedback.as_channel(compressors.power_sgd(1))
    assert feedback.as_channel(channel) is channel
    x = jnp.outer(jnp.arange(3.0), jnp.arange(4.0))
    send, recv = channel.init(x)

    @jax.jit  # one program: eager PowerSGD compiles each of its ops (~3 s)
    def round_trip(x, send, recv):
        payload, send = channel.send(x, send)
        x_hat, recv = channel.receive(payload, recv, x)
        return x_hat, send

    x_hat, send = round_trip(x, send, recv)
    np.testing.assert_allclose(x_hat, x, atol=1e-5)
    assert isinstance(send, compressors.PowerSGDState)


@pytest.mark.parametrize(
    "make",
    [
        lambda: feedback.error_feedback(TOPK, decay=0.0),
        lambda: feedback.error_feedback(TOPK, num_samples=0),
        lambda: feedback.aq_sgd(TOPK, 0),
    ],
)
def test_bad_parameters_raise(make):
    with pytest.raises(ValueError):
        make()


def test_channels_need_a_codec():
    with pytest.raises(TypeError):
        feedback.ef21("top_k")


def test_ef21_init_gives_distinct_buffers_that_can_be_donated():
    channel = feedback.ef21(TOPK)
    send, recv = channel.init(jnp.ones((8, 6)))
    assert send.estimate is not recv.estimate
    jax.jit(lambda s, r: (s, r), donate_argnums=(0, 1))(send, recv)


@pytest.mark.parametrize(
    "codec",
    [
        TOPK,
        Q4,
        compressors.sign(),
        compressors.rand_k(0.25),
        compressors.top_k(0.2, method="blockwise"),
    ],
    ids=lambda c: c.name,
)
def test_reduction_error_feedback_is_the_channels_error_feedback(codec):
    """One error-feedback rule: the reduction wrapper keeps exactly the channel's residual."""
    channel = feedback.error_feedback(codec)
    x = jax.random.normal(KEY, (8, 6))
    e = 0.3 * jax.random.normal(jax.random.key(1), (8, 6))
    key = jax.random.key(2)

    @jax.jit
    def both(x, e):
        payload, send = channel.send(x, feedback.ErrorFeedbackState(e, codec.init(x)), key)
        x_hat, _ = channel.receive(payload, compressors.EmptyState(), x)
        protocol = comm.plan_reduce(channel, x, min_compression_rate=0)
        state = protocol.init(x, None)
        state = state._replace(memory=feedback.ErrorFeedbackMemory(compressors.PerWorker(e[None])))
        mean, echo, state = protocol.all_reduce(x, state, key, None)
        return x_hat, send.residual, mean, echo, state.memory.residual.value[0]

    x_hat, residual, mean, echo, reduced = both(x, e)
    np.testing.assert_array_equal(reduced, residual)
    np.testing.assert_array_equal(echo, x_hat)
    np.testing.assert_allclose(mean, x_hat, rtol=1e-6)  # the mean of one worker


ADD_DECODED_CASES = [
    (compressors.top_k(0.1), (37, 11)),  # exact: a scatter into base
    (compressors.top_k(0.3, method="blockwise", block_size=7), (5, 9)),  # padded blocks
    (compressors.top_k(0.2, per_sample=True), (4, 13)),
    (compressors.top_k(0.2, per_sample=True, method="blockwise", block_size=4), (3, 10)),
    (compressors.top_k(0.1, method="blockwise"), (50, 20)),  # one per block (of 10): a mask
    (compressors.top_k(0.5), (0, 4)),  # zero-size
    (compressors.quantize(4), (8, 8)),  # no fast path: the dense form
]


@functools.cache
def _add_decoded_program(codec):
    """``codec``'s compress, decompress, ``add_decoded`` (both signs), ``compress_and_decode``
    and ``compress_into`` as one jitted program per case (eagerly, each of their operations
    compiled on its own: 40-66 compiles a case, the eager ``add_decoded`` calls' ~10 of them)."""

    @jax.jit
    def program(x, base):
        payload, _ = codec.compress(x, codec.init(x), None)
        added = [compressors.add_decoded(codec, base, payload, sign) for sign in (1, -1)]
        _, _, sent = compressors.compress_and_decode(codec, x, codec.init(x), None)
        out = compressors.compress_into(codec, x, codec.init(x), None, x, -1)
        return payload, codec.decompress(payload, x), added, sent, out[2], out[3]

    return program


@pytest.mark.slow
@pytest.mark.parametrize("codec,shape", ADD_DECODED_CASES, ids=lambda v: getattr(v, "name", v))
def test_add_decoded_and_compress_into_equal_the_dense_form(codec, shape):
    """What EF keeps (c - D(C(c))) and EF21 keeps (g + D(m)), eager and jitted, NaN/Inf too."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size:
        x[0, 0], x[1, 1] = np.nan, -np.inf
    base = rng.standard_normal(shape).astype(np.float32)
    payload, decoded, added, sent, out_decoded, out_into = (
        jax.tree.map(np.asarray, o) for o in _add_decoded_program(codec)(x, base)
    )
    with np.errstate(invalid="ignore"):  # inf - inf
        dense = {1: (base + decoded, added[0]), -1: (base - decoded, added[1]), "into": x - sent}
    for sign in (1, -1):
        want, jitted = dense[sign]
        eager = compressors.add_decoded(codec, jnp.asarray(base), payload, sign)
        np.testing.assert_array_equal(np.asarray(eager), want)
        np.testing.assert_array_equal(jitted, want)
    # the sender's decode: the codec's round trip where it has one (quantize), else decompress
    np.testing.assert_array_equal(out_decoded, sent)
    np.testing.assert_array_equal(out_into, dense["into"])
    with pytest.raises(ValueError, match="sign must be 1 or -1"):
        compressors.add_decoded(codec, base, payload, 2)
