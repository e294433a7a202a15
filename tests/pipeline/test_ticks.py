"""A tick moves the payloads of every boundary that sends in it in one ``ppermute`` per
direction (``jaxcomp.pipeline._ticks.move_boundaries``): a 4-stage GPipe step is one
``collective-permute`` per tick and direction that sends, not one per boundary and microbatch,
and boundaries of different shapes (each payload padded to the tick's largest) give the
unpipelined model's numbers and count the padded bytes they send."""

import jax
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp.pipeline import _links

#: inputs, the three boundaries, outputs: boundary payloads of 24, 8 and 12 float32 columns
WIDTHS = (16, 24, 8, 12, 16)


def _sending(schedule, num_stages, num_microbatches):
    """The (tick, direction) pairs of the schedule in which some boundary sends."""
    n = 0
    for row in pipeline.ticks(schedule, num_stages, num_microbatches):
        kinds = [None if op is None else op.kind for op in row]
        n += any(k == "F" for k in kinds[:-1]) + any(k == "B" for k in kinds[1:])
    return n


@pytest.fixture(scope="module")
def het(tools):
    return tools.make_mlp(widths=WIDTHS)


def test_one_permute_per_tick_and_direction_padded_to_the_largest(het, stage_mesh, pack, tools):
    pipe = pipeline.distribute(het.model, pipeline.PipelineConfig(het.M), stage_mesh)  # GPipe
    params = pack(het.params)
    states = pipe.init(params, het.batch)
    key = jax.random.key(0)
    compiled = jax.jit(pipe.step).lower(params, het.batch, states, key).compile()
    sent = _links.hlo_sent_bytes(compiled.as_text())
    # 6 forward ticks send (1, 2, 3, 3, 2, 1 boundaries) and 6 backward: 24 sends, 12 permutes
    assert sent["permutes"] == _sending("gpipe", 4, het.M) == 12

    loss, grads, _, metrics = compiled(params, het.batch, states, key)
    ref_loss, ref_grads = tools.reference(het.model, het.params, het.batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(grads.unpack(), ref_grads)

    # microbatches of 2 rows: payloads of 192, 64 and 96 bytes; every pair of a tick carries
    # its largest: forward 192 (1 + 2 + 3 + 3) + 2 * 96 + 96, against 4 (192 + 64 + 96)
    # unpadded; backward the same ticks mirrored
    counts = pipe.bytes_per_step(params, het.batch)
    assert sent["forward"] == sent["backward"] == 2016 > 4 * (192 + 64 + 96)
    assert counts["forward_bytes"] == counts["backward_bytes"] == 2016
    assert float(metrics["wire_bytes"]) == counts["wire_bytes"] == counts["dense_bytes"] == 4032


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_heterogeneous_compressed_payloads_equal_the_simulation(het, stage_mesh, pack, tools,
                                                                schedule):  # fmt: skip
    """Payloads of different structures per boundary (quantized codes and a scale): the
    distributed step equals the simulation and sends the padded bytes its metrics count."""
    link = pipeline.link(C.quantize(8), C.quantize(4, rounding="stochastic"))
    config = pipeline.PipelineConfig(het.M, link, schedule=schedule)
    pipe, sim = (
        pipeline.distribute(het.model, config, stage_mesh),
        pipeline.simulate(het.model, config),
    )
    params = pack(het.params)
    states, sim_states = pipe.init(params, het.batch), sim.init(het.params, het.batch)
    key = jax.random.key(1)
    compiled = jax.jit(pipe.step).lower(params, het.batch, states, key).compile()
    loss, grads, _, metrics = compiled(params, het.batch, states, key)
    s_loss, s_grads, _, s_metrics = jax.jit(sim.step)(het.params, het.batch, sim_states, key)
    np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
    tools.close(grads.unpack(), s_grads)
    sent = _links.hlo_sent_bytes(compiled.as_text())
    counts = pipe.bytes_per_step(params, het.batch)
    assert (
        sent["forward"] + sent["backward"] == counts["wire_bytes"] == float(metrics["wire_bytes"])
    )
    assert float(s_metrics["wire_bytes"]) == counts["wire_bytes"] < counts["dense_bytes"]
    assert sent["permutes"] == _sending(schedule, 4, het.M)
