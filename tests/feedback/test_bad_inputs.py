"""Channels at the edge: shapes other than init's, bad sample ids, impossible combinations.

One table of bad inputs, each raising an error whose message names the problem; then the
documented behaviour inside ``jit``, where ids cannot raise: an out-of-range id reads a NaN row
and writes nothing (never a clamped or wrapped row), and a repeated id writes its last
occurrence, identically at both ends.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback

X = jnp.ones((8, 6))
TOPK = compressors.top_k(0.5)
Q8 = compressors.quantize(8)


def ef_send(shape=(8, 6), dtype=jnp.float32, channel=None):
    channel = channel or feedback.error_feedback(TOPK)
    send, _ = channel.init(X)
    channel.send(jnp.ones(shape, dtype), send)


def ef21_receive(shape):
    channel = feedback.ef21(Q8)
    send, recv = channel.init(X)
    payload, _ = channel.send(X, send)
    channel.receive(payload, recv, jax.ShapeDtypeStruct(shape, jnp.float32))


def aq(method, shape=(4, 6), ids=(0, 1, 2, 3)):
    channel = feedback.aq_sgd(compressors.quantize(4), 10)
    send, recv = channel.init(jnp.ones((4, 6)))
    x = jnp.ones(shape)
    ids = None if ids is None else jnp.asarray(ids)
    if method == "send":
        channel.send(x, send, None, ids)
    else:
        channel.dense_receive(x, recv, ids)


def per_sample_ef_rows():
    channel = feedback.error_feedback(compressors.top_k(0.5, per_sample=True), num_samples=10)
    send, _ = channel.init(X)
    channel.send(jnp.ones((8, 5)), send, ids=jnp.arange(8))


def reduction_drift():
    protocol = comm.plan_reduce(feedback.error_feedback(Q8), X)
    protocol.all_reduce(jnp.ones((8, 6)), protocol.init(jnp.ones((8, 5)), None), None, None)


CASES = [
    # (case, call, error type, the message must name ...)
    (
        "ef_broadcastable_shape",
        lambda: ef_send((8, 1)),
        ValueError,
        r"float32\[8,6\]; got float32\[8,1\]",
    ),
    (
        "ef_other_dtype",
        lambda: ef_send(dtype=jnp.bfloat16),
        ValueError,
        r"float32\[8,6\]; got bfloat16\[8,6\]",
    ),
    (
        "ef_per_sample_rows",
        per_sample_ef_rows,
        ValueError,
        r"per-sample rows of float32\[10,6\]",
    ),
    (
        "ef21_send_shape",
        lambda: ef_send((8, 1), channel=feedback.ef21(Q8)),
        ValueError,
        r"ef21.*float32\[8,1\]",
    ),
    (
        "ef21_receive_like",
        lambda: ef21_receive((4, 6)),
        ValueError,
        r"built for float32\[8,6\]; got float32\[4,6\]",
    ),
    (
        "aq_sgd_send_features",
        lambda: aq("send", (4, 7)),
        ValueError,
        r"per-sample rows of float16\[10,6\]",
    ),
    ("aq_sgd_dense_features", lambda: aq("dense", (4, 7)), ValueError, r"got float32\[4,7\]"),
    ("aq_sgd_no_ids", lambda: aq("send", ids=None), ValueError, "pass the sample ids"),
    (
        "aq_sgd_ids_shape",
        lambda: aq("send", ids=(0, 1, 2)),
        ValueError,
        r"ids must have shape \(4,\)",
    ),
    (
        "aq_sgd_float_ids",
        lambda: aq("send", ids=(0.0, 1.0, 2.0, 3.0)),
        TypeError,
        "ids must be integers",
    ),
    (
        "host_ids_out_of_range",
        lambda: feedback.check_sample_ids([0, 10, 3], 10),
        ValueError,
        r"in \[0, 10\); got 10",
    ),
    ("host_ids_negative", lambda: feedback.check_sample_ids([-1, 2], 10), ValueError, r"got -1"),
    (
        "host_ids_repeated",
        lambda: feedback.check_sample_ids([3, 1, 3], 10),
        ValueError,
        "repeat within one batch: 3",
    ),
    ("host_ids_float", lambda: feedback.check_sample_ids([0.5], 10), TypeError, "must be integers"),
    (
        "host_ids_traced",
        lambda: jax.jit(lambda i: feedback.check_sample_ids(i, 10))(jnp.arange(2)),
        TypeError,
        "host values",
    ),
    ("reduction_memory_drift", reduction_drift, ValueError, r"float32\[8,5\]; got float32\[8,6\]"),
    (
        "ef21_on_two_phase",
        lambda: comm.plan_reduce(feedback.ef21(Q8), X, path="two_phase"),
        ValueError,
        "EF21",
    ),
    (
        "aq_sgd_in_a_reduction",
        lambda: comm.plan_reduce(feedback.aq_sgd(Q8, 10), X),
        ValueError,
        "per-sample buffers",
    ),
    (
        "decay_zero",
        lambda: feedback.error_feedback(TOPK, decay=0.0),
        ValueError,
        r"decay must be a fraction in \(0, 1\]",
    ),
    (
        "num_samples_zero",
        lambda: feedback.aq_sgd(TOPK, 0),
        ValueError,
        "num_samples must be an integer >= 1",
    ),
    ("channel_of_a_string", lambda: feedback.ef21("top_k"), TypeError, "takes a Codec"),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_an_error_naming_the_problem(case, call, error, message):
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# Inside jit: the documented id rule


def aq_step(channel):
    @jax.jit
    def step(x, send, recv, ids):
        payload, send = channel.send(x, send, None, ids)
        x_hat, recv = channel.receive(payload, recv, x, ids)
        return x_hat, send, recv

    return step


def test_out_of_range_ids_read_nan_rows_and_write_nothing():
    # a per-sample codec keeps rows independent (a tensor-scaled one spreads the NaN batch-wide)
    codec = compressors.top_k(0.6, per_sample=True)
    channel = feedback.aq_sgd(codec, 6, buffer_dtype=jnp.float32)
    data = jax.random.normal(jax.random.key(0), (6, 5))
    send, recv = channel.init(data[:4])
    ids = jnp.arange(6)
    send, recv = channel.dense_send(data, send, ids), channel.dense_receive(data, recv, ids)
    x = data[jnp.array([0, 5, 2, 1])] + 0.1
    x_hat, new_send, new_recv = aq_step(channel)(x, send, recv, jnp.array([0, 6, -1, 1]))
    x_hat = np.asarray(x_hat)
    assert np.isnan(x_hat[1]).all() and np.isnan(x_hat[2]).all()  # id 6 and id -1
    assert np.isfinite(x_hat[[0, 3]]).all()
    for state, old in ((new_send, send), (new_recv, recv)):
        est = np.asarray(state.estimate)
        np.testing.assert_array_equal(est[[2, 3, 4, 5]], np.asarray(old.estimate)[[2, 3, 4, 5]])
        assert not np.array_equal(est[0], np.asarray(old.estimate)[0])  # valid ids were written
    np.testing.assert_array_equal(new_send.estimate, new_recv.estimate)


def test_a_repeated_id_reads_the_old_row_and_writes_its_last_occurrence():
    channel = feedback.aq_sgd(compressors.quantize(8), 4, buffer_dtype=jnp.float32)
    send, recv = channel.init(jnp.ones((3, 5)))
    x = jnp.stack([jnp.full(5, 1.0), jnp.full(5, 2.0), jnp.full(5, 3.0)])
    x_hat, send, recv = aq_step(channel)(x, send, recv, jnp.array([2, 2, 0]))
    # both occurrences are decoded against the same (zero) old row, each from its own delta
    np.testing.assert_allclose(np.asarray(x_hat), np.asarray(x), rtol=1e-2)
    np.testing.assert_allclose(np.asarray(send.estimate)[2], np.asarray(x_hat)[1])  # the last
    np.testing.assert_array_equal(send.estimate, recv.estimate)


def test_per_sample_error_feedback_out_of_range_ids_give_nan_and_keep_the_residual():
    channel = feedback.error_feedback(compressors.top_k(0.5, per_sample=True), num_samples=4)
    send, _ = channel.init(jnp.ones((2, 6)))
    send = send._replace(residual=jnp.ones((4, 6)))
    payload, new = jax.jit(lambda x, s, i: channel.send(x, s, None, i))(
        jnp.ones((2, 6)), send, jnp.array([1, 4])
    )
    decoded = np.asarray(channel.receive(payload, None, jnp.ones((2, 6)))[0])
    assert np.isnan(decoded[1]).any() and np.isfinite(decoded[0]).all()
    np.testing.assert_array_equal(np.asarray(new.residual)[[0, 2, 3]], 1.0)  # untouched
