"""A tick moves the payloads of every boundary that sends in it in one ``ppermute`` per payload
size (``jaxcomp.pipeline._ticks.move_boundaries``), both directions together where no stage
receives twice (1F1B): a step of boundaries alike is one ``collective-permute`` per tick that
sends, not one per boundary and microbatch (GPipe's 4-stage MLP: test_gpipe.py's identity test,
its program), and boundaries of different sizes (the test CNN's) send exactly their payloads'
bytes, no padding, with the unpipelined model's numbers."""

import jax
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback
from jaxcomp import pipeline
from jaxcomp.pipeline import _links
from jaxcomp.pipeline import _ticks

#: inputs, the two boundaries of a 3-stage MLP (a first, a middle and a last stage), outputs:
#: boundary payloads of 24 and 8 float32 columns
WIDTHS = (16, 24, 8, 16)


def _moves(schedule, num_stages, num_microbatches, sizes=None):
    """The permutes of the schedule's step: per tick in which some boundary sends, one per
    distinct payload size among its sends of both directions (``sizes``: per boundary,
    ``(forward, backward)`` bytes; ``None``: all alike). Neither schedule has a stage that
    receives from both sides in one tick (GPipe: no tick sends both ways)."""
    n = 0
    for row in pipeline.ticks(schedule, num_stages, num_microbatches):
        kinds = [None if op is None else op.kind for op in row]
        n += len({0 if sizes is None else sizes[b][back]
                  for back, kind in ((0, "F"), (1, "B"))
                  for b in range(num_stages - 1) if kinds[b + back] == kind})  # fmt: skip
    return n


def _split(kinds, merged=_ticks.tick_moves):
    """The tick's moves as the engine made them before 1F1B merged them: one per direction."""
    pairs = [p for move in merged(kinds) for p in move]
    moves = (tuple(p for p in pairs if p[0] < p[1]), tuple(p for p in pairs if p[0] > p[1]))
    return tuple(m for m in moves if m)


@pytest.fixture(scope="module")
def het(tools):
    return tools.make_mlp(num_microbatches=3, num_stages=3, widths=WIDTHS)


def test_boundaries_of_different_sizes_send_no_padding(stage_mesh3, pack, tools, cnn):
    """The 3-stage test CNN's boundaries carry 256 and 128 float32 per row: the compiled step's
    permutes carry exactly the payloads (every boundary's bytes once per microbatch and
    direction), one permute per tick, direction and payload size (12, where boundaries alike
    take 8); its loss, gradients, metrics and evaluation are the unpipelined model's (GPipe;
    1F1B's dense step: test_golden.py's ``cnn_aq`` warm-up)."""
    stage_mesh = stage_mesh3
    pipe = pipeline.distribute(cnn.model, pipeline.PipelineConfig(cnn.M), stage_mesh)  # GPipe
    params = pack(cnn.params, stage_mesh)
    states = pipe.init(params, cnn.batch)
    compiled = jax.jit(pipe.step).lower(params, cnn.batch, states, None).compile()
    loss, grads, _, metrics = compiled(params, cnn.batch, states, None)
    ref_loss, h, accuracy = tools.check_unpipelined(cnn, loss, grads, metrics)
    # evaluation: the last stage's outputs for the whole batch, and the loss_fn metrics
    e_loss, e_metrics, logits = jax.jit(pipe.evaluate)(params, cnn.batch)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(h), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e_loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(e_metrics["accuracy"], accuracy, rtol=1e-6)

    payloads = [2 * 4 * n for n in (8 * 8 * 4, 4 * 4 * 8)]  # microbatches of 2 rows
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    counts = pipe.bytes_per_step(params, cnn.batch)
    assert sent["forward"] == sent["backward"] == cnn.M * sum(payloads) == 9216
    assert counts["forward_bytes"] == counts["backward_bytes"] == 9216
    assert float(metrics["wire_bytes"]) == counts["wire_bytes"] == counts["dense_bytes"]
    sizes = [(n, n) for n in payloads]
    assert sent["permutes"] == _moves("gpipe", 3, cnn.M, sizes) == 12 > _moves("gpipe", 3, 3)


#: 1F1B's merged moves against the per-direction ones: identity (one permute per tick); error
#: feedback on 4-bit forward and 8-bit backward payloads (link states, every tick cut at both
#: directions' sizes)
MERGED = {
    "identity": pipeline.link(),
    "ef_quantize_4_8": pipeline.link(
        feedback.error_feedback(C.quantize(4)), feedback.error_feedback(C.quantize(8))
    ),
}


def _both_ways(text):
    """Executions of the permutes that carry pairs of both directions."""
    permutes = [r for r in comm.collective_report(text).records if r.kind == "collective-permute"]
    return sum(r.executions for r in permutes if len({s < d for s, d in r.pairs}) == 2)


def _two_steps(pipe, params, batch):
    states = pipe.init(params, batch)
    compiled = jax.jit(pipe.step).lower(params, batch, states, None).compile()
    loss, grads, states, metrics = compiled(params, batch, states, None)
    loss2, grads2, states2, _ = compiled(params, batch, states, None)
    out = (loss, grads.unpack(), states, metrics, loss2, grads2.unpack(), states2)
    return compiled.as_text(), jax.tree.map(np.asarray, out)


@pytest.mark.parametrize(
    "name", ["identity", pytest.param("ef_quantize_4_8", marks=pytest.mark.slow)]
)
def test_1f1b_moves_both_directions_of_a_tick_in_one_permute(name, mlp3, stage_mesh3, pack,
                                                             monkeypatch):  # fmt: skip
    """Under 1F1B a tick's forward pairs and backward pairs are one permutation: one move per
    tick that sends, one permute per distinct payload size of both directions, the same bytes
    (the meter tells each pair's direction in a merged permute), and two steps bit-identical
    (losses, gradients, link states) to the program that moves each direction apart."""
    mlp, stage_mesh = mlp3, stage_mesh3
    config = pipeline.PipelineConfig(mlp.M, MERGED[name], schedule="1f1b")
    params = pack(mlp.params, stage_mesh)
    pipe = pipeline.distribute(mlp.model, config, stage_mesh)
    text, merged = _two_steps(pipe, params, mlp.batch)
    monkeypatch.setattr(_ticks, "tick_moves", _split)
    split_text, split = _two_steps(pipeline.distribute(mlp.model, config, stage_mesh), params,
                                   mlp.batch)  # fmt: skip
    jax.tree.map(np.testing.assert_array_equal, merged, split)
    sent, split_sent = (_links.hlo_sent_bytes(t, stage_mesh) for t in (text, split_text))
    counts = pipe.bytes_per_step(params, mlp.batch)
    assert sent["forward"] == split_sent["forward"] == counts["forward_bytes"] > 0
    assert sent["backward"] == split_sent["backward"] == counts["backward_bytes"] > 0
    assert sent["other"] == split_sent["other"] == 0
    shape = jax.ShapeDtypeStruct((2, 16), np.float32)
    fwd, bwd = _links.link_bytes(MERGED[name], shape, True)
    # 10 ticks, 9 send: 3 both ways (identity: 1 permute, else 2), 6 one way (1 each)
    assert sent["permutes"] == _moves("1f1b", 3, mlp.M, [(fwd, bwd)] * 2)
    assert sent["permutes"] == (9 if fwd == bwd else 12)
    assert split_sent["permutes"] == 12
    assert (_both_ways(text), _both_ways(split_text)) == (3, 0)


HET_LINK = pipeline.link(C.quantize(8), C.quantize(4, rounding="stochastic"))


@pytest.fixture(scope="module")
def het_simulated(het):
    """The simulation's step of ``HET_LINK`` on ``het`` with key 1 (``config.schedule`` does not
    change what it computes: one run for both schedules' tests)."""
    sim = pipeline.simulate(het.model, pipeline.PipelineConfig(het.M, HET_LINK))
    states = sim.init(het.params, het.batch)
    return jax.jit(sim.step)(het.params, het.batch, states, jax.random.key(1))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipeline.SCHEDULES)
def test_heterogeneous_compressed_payloads_equal_the_simulation(
    het, het_simulated, stage_mesh3, pack, tools, schedule
):
    """Payloads of different structures and sizes per boundary (quantized codes and a scale):
    the distributed step equals the simulation and sends exactly the payloads' bytes."""
    link = HET_LINK
    config = pipeline.PipelineConfig(het.M, link, schedule=schedule)
    stage_mesh = stage_mesh3
    pipe = pipeline.distribute(het.model, config, stage_mesh)
    params = pack(het.params, stage_mesh)
    states = pipe.init(params, het.batch)
    key = jax.random.key(1)
    compiled = jax.jit(pipe.step).lower(params, het.batch, states, key).compile()
    loss, grads, _, metrics = compiled(params, het.batch, states, key)
    s_loss, s_grads, _, s_metrics = het_simulated
    np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
    tools.close(grads.unpack(), s_grads)
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    counts = pipe.bytes_per_step(params, het.batch)
    shapes = [jax.ShapeDtypeStruct((2, w), np.float32) for w in WIDTHS[1:-1]]
    sizes = [_links.link_bytes(link, s, True) for s in shapes]
    assert len({f for f, _ in sizes}) == len({b for _, b in sizes}) == 2
    assert sent["forward"] == counts["forward_bytes"] == het.M * sum(f for f, _ in sizes)
    assert sent["backward"] == counts["backward_bytes"] == het.M * sum(b for _, b in sizes)
    assert counts["wire_bytes"] == float(metrics["wire_bytes"]) == float(s_metrics["wire_bytes"])
    assert counts["wire_bytes"] < counts["dense_bytes"]
    assert sent["permutes"] == _moves(schedule, 3, het.M, sizes)
