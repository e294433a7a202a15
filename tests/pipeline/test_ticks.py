"""A tick moves the payloads of every boundary that sends in it in one ``ppermute`` per
direction and payload size (``jaxcomp.pipeline._ticks.move_boundaries``): a 4-stage GPipe step
of boundaries alike is one ``collective-permute`` per tick and direction that sends, not one per
boundary and microbatch, and boundaries of different sizes (the test CNN's) send exactly their
payloads' bytes, no padding, with the unpipelined model's numbers."""

import jax
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp.pipeline import _links

#: inputs, the three boundaries, outputs: boundary payloads of 24, 8 and 12 float32 columns
WIDTHS = (16, 24, 8, 12, 16)


def _moves(schedule, num_stages, num_microbatches, sizes=None):
    """The permutes of the schedule's step: per (tick, direction) in which some boundary
    sends, one per distinct payload size among the sending boundaries (``sizes``: per
    boundary, ``(forward, backward)`` bytes; ``None``: all alike)."""
    n = 0
    for row in pipeline.ticks(schedule, num_stages, num_microbatches):
        kinds = [None if op is None else op.kind for op in row]
        for back, kind in ((0, "F"), (1, "B")):
            active = [b for b in range(num_stages - 1) if kinds[b + back] == kind]
            n += len({0 if sizes is None else sizes[b][back] for b in active})
    return n


@pytest.fixture(scope="module")
def het(tools):
    return tools.make_mlp(widths=WIDTHS)


def test_boundaries_of_different_sizes_send_no_padding(stage_mesh, pack, tools):
    """The test CNN's boundaries carry 512, 256 and 128 float32 per row: the compiled step's
    permutes carry exactly the payloads (every boundary's bytes once per microbatch and
    direction), one permute per tick, direction and payload size."""
    cnn = tools.make_cnn()
    pipe = pipeline.distribute(cnn.model, pipeline.PipelineConfig(cnn.M), stage_mesh)  # GPipe
    params = pack(cnn.params)
    states = pipe.init(params, cnn.batch)
    compiled = jax.jit(pipe.step).lower(params, cnn.batch, states, None).compile()
    loss, grads, _, metrics = compiled(params, cnn.batch, states, None)
    ref_loss, ref_grads = tools.reference(cnn.model, cnn.params, cnn.batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    tools.close(grads.unpack(), ref_grads)

    payloads = [2 * 4 * n for n in (8 * 8 * 4, 4 * 4 * 8, 2 * 2 * 16)]  # microbatches of 2 rows
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    counts = pipe.bytes_per_step(params, cnn.batch)
    assert sent["forward"] == sent["backward"] == cnn.M * sum(payloads) == 14336
    assert counts["forward_bytes"] == counts["backward_bytes"] == 14336
    assert float(metrics["wire_bytes"]) == counts["wire_bytes"] == counts["dense_bytes"]
    sizes = [(n, n) for n in payloads]
    assert sent["permutes"] == _moves("gpipe", 4, cnn.M, sizes) == 24


def test_one_permute_per_tick_and_direction_for_boundaries_alike(mlp, stage_mesh, pack):
    """Boundaries of one payload shape move in one permute per tick and direction."""
    pipe = pipeline.distribute(mlp.model, pipeline.PipelineConfig(mlp.M), stage_mesh)
    params = pack(mlp.params)
    states = pipe.init(params, mlp.batch)
    text = jax.jit(pipe.step).lower(params, mlp.batch, states, None).compile().as_text()
    sent = _links.hlo_sent_bytes(text, stage_mesh)
    # 6 forward ticks send (1, 2, 3, 3, 2, 1 boundaries) and 6 backward: 24 sends, 12 permutes
    assert sent["permutes"] == _moves("gpipe", 4, mlp.M) == 12
    assert sent["forward"] == sent["backward"] == mlp.M * 3 * 2 * 16 * 4


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_heterogeneous_compressed_payloads_equal_the_simulation(het, stage_mesh, pack, tools,
                                                                schedule):  # fmt: skip
    """Payloads of different structures and sizes per boundary (quantized codes and a scale):
    the distributed step equals the simulation and sends exactly the payloads' bytes."""
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
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    counts = pipe.bytes_per_step(params, het.batch)
    shapes = [jax.ShapeDtypeStruct((2, w), np.float32) for w in WIDTHS[1:-1]]
    sizes = [_links.link_bytes(link, s, True) for s in shapes]
    assert len({f for f, _ in sizes}) == len({b for _, b in sizes}) == 3
    assert sent["forward"] == counts["forward_bytes"] == het.M * sum(f for f, _ in sizes)
    assert sent["backward"] == counts["backward_bytes"] == het.M * sum(b for _, b in sizes)
    assert counts["wire_bytes"] == float(metrics["wire_bytes"]) == float(s_metrics["wire_bytes"])
    assert counts["wire_bytes"] < counts["dense_bytes"]
    assert sent["permutes"] == _moves(schedule, 4, het.M, sizes)
