"""Data-parallel transforms at the edge: one table, each error naming the problem.

Static parameters (steps, intervals, seeds, the compression policy) fix the trace, so they must
be Python numbers: an array (e.g. from ``optax.inject_hyperparams`` without ``static_args``)
or a negative value is an error at construction, never a division by zero later. A state
accepts only the parameter shapes and dtypes it was initialised with.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import transforms

pytestmark = pytest.mark.usefixtures("fast_compiles")

TOPK = compressors.top_k(0.25)
PARAMS = {"w": jnp.zeros((8, 6))}
mean = transforms.compressed_mean
acc = transforms.accordion
batch = transforms.accordion_batch_size
SGD = optax.sgd(0.1)


def update_with(tx, grads, params=PARAMS):
    """``tx.update(grads)`` on a state initialised for ``params`` (one worker)."""
    tx.update(grads, tx.init(params))


def placed_state_without_shard_map():
    tx = mean(feedback.error_feedback(TOPK), axis_name=None)
    mesh = comm.make_mesh([(comm.DATA, 2)], jax.devices()[:2])
    tx.update(PARAMS, comm.place_state(tx.init(PARAMS), mesh, comm.DATA))


def two_phase_init_without_mesh():
    mean(compressors.quantize(8), path="two_phase").init(PARAMS)


CASES = [
    # (case, call, error type, the message must name ...)
    (
        "mean_warmup_array",
        lambda: mean(TOPK, warmup_steps=jnp.array(2)),
        ValueError,
        "warmup_steps must be a Python int.*static_args",
    ),
    (
        "mean_warmup_negative",
        lambda: mean(TOPK, warmup_steps=-1),
        ValueError,
        "warmup_steps must be an integer >= 0",
    ),
    (
        "mean_seed_array",
        lambda: mean(TOPK, seed=jnp.array(0)),
        ValueError,
        "seed must be a Python int",
    ),
    ("mean_seed_float", lambda: mean(TOPK, seed=1.5), ValueError, "seed must be an integer >= 0"),
    (
        "mean_min_ndim_array",
        lambda: mean(TOPK, min_ndim=jnp.array(1)),
        ValueError,
        "min_ndim must be a Python int",
    ),
    (
        "mean_rate_array",
        lambda: mean(TOPK, min_compression_rate=jnp.array(2.0)),
        ValueError,
        "min_compression_rate must be a Python number",
    ),
    (
        "mean_rate_nan",
        lambda: mean(TOPK, min_compression_rate=float("nan")),
        ValueError,
        "min_compression_rate must be a number >= 0",
    ),
    (
        "mean_rate_negative",
        lambda: mean(TOPK, min_compression_rate=-1),
        ValueError,
        "min_compression_rate must be a number >= 0",
    ),
    ("mean_unknown_path", lambda: mean(TOPK, path="ring"), ValueError, "path must be one of"),
    ("mean_codec_path_without_protocol", lambda: mean(TOPK, path="codec"), ValueError, "has none"),
    (
        "mean_psum_path_for_top_k",
        lambda: mean(TOPK, path="psum"),
        ValueError,
        "needs a summable codec",
    ),
    ("mean_aq_sgd", lambda: mean(feedback.aq_sgd(TOPK, 10)), ValueError, "per-sample buffers"),
    (
        "mean_axis_number",
        lambda: mean(TOPK, axis_name=3),
        ValueError,
        "axis_name must be a mesh axis name",
    ),
    ("mean_of_an_optimizer", lambda: mean(SGD), TypeError, "Codec or Channel"),
    (
        "mean_shape_other_than_init",
        lambda: update_with(mean(feedback.error_feedback(TOPK), None), {"w": jnp.ones((8, 1))}),
        ValueError,
        r"parameter \['w'\] was not built for float32\[8,1\]",
    ),
    (
        "mean_dtype_other_than_init",
        lambda: update_with(mean(feedback.ef21(TOPK), None), {"w": jnp.ones((8, 6), jnp.bfloat16)}),
        ValueError,
        r"not built for bfloat16\[8,6\]",
    ),
    (
        "mean_other_tree",
        lambda: update_with(mean(TOPK, None), {"v": jnp.ones((8, 6))}),
        ValueError,
        "updates tree does not match",
    ),
    (
        "mean_outside_shard_map",
        lambda: update_with(mean(TOPK), PARAMS),
        ValueError,
        "not inside shard_map",
    ),
    (
        "mean_placed_state_without_axis",
        placed_state_without_shard_map,
        ValueError,
        "was not built for",
    ),
    (
        "two_phase_init_without_mesh",
        two_phase_init_without_mesh,
        ValueError,
        "sized by the number of workers",
    ),
    (
        "accordion_interval_array",
        lambda: acc(interval_steps=jnp.array(0)),
        ValueError,
        "interval_steps must be a Python int.*static_args",
    ),
    (
        "accordion_interval_zero",
        lambda: acc(interval_steps=0),
        ValueError,
        "interval_steps must be an integer >= 1",
    ),
    (
        "accordion_interval_negative",
        lambda: acc(interval_steps=-3),
        ValueError,
        "interval_steps must be an integer >= 1",
    ),
    (
        "accordion_interval_float",
        lambda: acc(interval_steps=2.5),
        ValueError,
        "interval_steps must be an integer >= 1",
    ),
    (
        "accordion_check_every_array",
        lambda: acc(interval_steps=2, check_every=jnp.array(1)),
        ValueError,
        "check_every must be a Python int",
    ),
    (
        "accordion_seed_array",
        lambda: acc(interval_steps=2, seed=jnp.array(1)),
        ValueError,
        "seed must be a Python int",
    ),
    (
        "accordion_eta_zero",
        lambda: acc(interval_steps=2, eta=0),
        ValueError,
        "eta must be a number > 0",
    ),
    (
        "accordion_eta_nan",
        lambda: acc(interval_steps=2, eta=float("nan")),
        ValueError,
        "eta must be a number > 0",
    ),
    (
        "accordion_mixed_feedback",
        lambda: acc(feedback.error_feedback(TOPK), feedback.ef21(TOPK), interval_steps=2),
        ValueError,
        "must compensate alike",
    ),
    (
        "accordion_different_decay",
        lambda: acc(feedback.error_feedback(TOPK, decay=0.5), TOPK, interval_steps=2),
        ValueError,
        r"\(error_feedback\(decay=0.5\)\) and .*\(error_feedback\(decay=1\)\)",
    ),
    (
        "accordion_channel_without_feedback_flag",
        lambda: acc(feedback.error_feedback(TOPK), TOPK, interval_steps=2, error_feedback=False),
        ValueError,
        "error_feedback=False applies to codecs",
    ),
    (
        "accordion_of_an_optimizer",
        lambda: acc(SGD, interval_steps=2),
        TypeError,
        "must be a jaxcomp Codec or Channel",
    ),
    (
        "accordion_aq_sgd",
        lambda: acc(feedback.aq_sgd(TOPK, 10), feedback.aq_sgd(TOPK, 10), interval_steps=2),
        ValueError,
        "per-sample buffers",
    ),
    (
        "accordion_shape_other_than_init",
        lambda: update_with(
            acc(TOPK, TOPK, interval_steps=2, axis_name=None), {"w": jnp.ones((8, 1))}
        ),
        ValueError,
        r"parameter \['w'\] was not built for float32\[8,1\]",
    ),
    (
        "batch_interval_array",
        lambda: batch(SGD, interval_steps=jnp.array(4)),
        ValueError,
        "interval_steps must be a Python int",
    ),
    (
        "batch_small_steps_array",
        lambda: batch(SGD, interval_steps=4, small_steps=jnp.array(1)),
        ValueError,
        "small_steps must be a Python int",
    ),
    (
        "batch_large_steps_zero",
        lambda: batch(SGD, interval_steps=4, large_steps=0),
        ValueError,
        "large_steps must be an integer >= 1",
    ),
    (
        "batch_large_below_small",
        lambda: batch(SGD, interval_steps=4, small_steps=4, large_steps=2),
        ValueError,
        r"large_steps \(2\) must be >= small_steps \(4\)",
    ),
    (
        "batch_shape_other_than_init",
        lambda: update_with(batch(SGD, interval_steps=4, axis_name=None), {"w": jnp.ones((8, 1))}),
        ValueError,
        r"parameter \['w'\] is float32\[1,8,6\]",
    ),
    (
        "place_state_unknown_axis",
        lambda: comm.place_state(
            mean(TOPK).init(PARAMS), comm.make_mesh([(comm.DATA, 2)], jax.devices()[:2]), "batch"
        ),
        ValueError,
        "'batch' is not an axis of the mesh",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_an_error_naming_the_problem(case, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_static_parameters_pass_through_inject_hyperparams_static_args():
    """The remedy the messages name works: static args stay Python values."""
    tx = optax.inject_hyperparams(
        transforms.accordion,
        static_args=("interval_steps", "check_every", "seed", "min_compression_rate", "min_ndim"),
    )(interval_steps=2, axis_name=None)
    state = tx.init(PARAMS)
    _, state = jax.jit(tx.update)({"w": jnp.ones((8, 6))}, state)
    assert int(state.inner_state.count) == 1
