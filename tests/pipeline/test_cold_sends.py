"""Per-sample buffers report the sends that met a cold buffer (a row this replica never
filled): 0 when every sample comes back to the replica that filled it, the full count when a
user's loop feeds the same ids to the other replica. The flags are local state: the
compressed program's boundary sends are R times one replica's payloads, no more (its compiled
HLO, read by the data x stage meter: ``check_data_stage_meter``, tests/pipeline/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp.pipeline import _link_state

N = 16  # sample ids (rows of every per-sample buffer)
# AQ-SGD forward (sender: stage b), per-sample EF backward (sender: stage b + 1)
LINK = pipeline.link(F.aq_sgd(C.quantize(4), N), F.error_feedback(C.top_k(0.5), num_samples=N))
S = 3  # stages: a first, a middle and a last
SENDERS = 2 * (S - 1)  # per-sample sender ends of the S - 1 boundaries


@pytest.fixture(scope="module")
def run(tools):
    """A (data 2 x stage 3) pipeline of 2 x 3 microbatches of 1 row: ``run(ids, compress)``
    steps from the states of the previous call and returns its metrics."""
    mlp = tools.make_mlp(num_microbatches=S, microbatch=1, num_stages=S)
    batch = {k: jnp.concatenate([v, v]) for k, v in mlp.batch.items()}  # 2 x 3 rows
    config = pipeline.PipelineConfig(mlp.M, LINK)
    mesh = pipeline.pipeline_mesh(S, jax.devices()[: 2 * S])
    pipe = pipeline.distribute(mlp.model, config, mesh)
    step = jax.jit(pipe.step, static_argnames="compress")
    held = {"states": pipe.init(mlp.params, batch)}
    compiled = {}

    def go(ids, compress):
        b = {**batch, "ids": jnp.asarray(ids, jnp.int32)}
        if compress not in compiled:
            compiled[compress] = step.lower(mlp.params, b, held["states"], None, compress).compile()
            if compress:
                tools.check_data_stage_meter(
                    compiled[compress].as_text(), pipe, mlp.params, b, mesh
                )
        _, _, held["states"], metrics = compiled[compress](mlp.params, b, held["states"], None)
        return metrics, held["states"]

    return go


def test_cold_sends_count_ids_fed_to_the_replica_that_never_filled_them(run):
    first, second = [0, 1, 2], [3, 4, 5]  # replica 0's rows, replica 1's
    metrics, states = run(first + second, False)  # the warm-up fills each replica's rows
    assert "cold_sends" not in metrics  # dense sends fill the caches; none is compressed
    metrics, _ = run(first + second, True)
    assert int(metrics["cold_sends"]) == 0
    # a user's loop: the same ids on the other replica; all cold on both replicas
    cold = run(second + first, True)[0]
    assert int(cold["cold_sends"]) == SENDERS * 6
    # now each replica has filled all 6 (a stale row is not cold); unseen ids are
    assert int(run(second + first, True)[0]["cold_sends"]) == 0
    # replica 0: 8 is cold in its first microbatch only; replica 1: 16 and -1 are out of range
    unseen = run([8, 8, 15] + [16, -1, 1], True)[0]
    assert int(unseen["cold_sends"]) == SENDERS * 2


def test_seen_flags_are_one_uint8_column_per_rows_count(tools):
    mlp = tools.make_mlp(num_microbatches=S, microbatch=1, num_stages=S)
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, LINK))
    states = sim.init(mlp.params, mlp.batch)
    flags = states.buffers[f"{_link_state.SEEN}[{N} rows]"]
    assert flags.dtype == jnp.uint8 and flags.shape == (S, N, 1) and not np.any(flags)
    step = jax.jit(sim.step, static_argnames="compress")
    _, _, states, metrics = step(mlp.params, mlp.batch, states, None, compress=True)
    assert int(metrics["cold_sends"]) == SENDERS * S  # never filled: the first step is cold
    flags = np.asarray(states.buffers[f"{_link_state.SEEN}[{N} rows]"])[..., 0]
    np.testing.assert_array_equal(flags, np.repeat((np.arange(N) < S)[None], S, 0))
    assert int(step(mlp.params, mlp.batch, states, None, compress=True)[3]["cold_sends"]) == 0
