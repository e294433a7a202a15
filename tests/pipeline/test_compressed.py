"""Compressed links: distributed == simulated (loss, grads, link states over several steps),
and the bytes the compiled program sends == the theoretical payload bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp.pipeline import _links

N = 6  # samples in the test batch (per-sample buffers)

LINKS = {
    "topk_ef": pipeline.link(
        F.error_feedback(C.top_k(0.25, per_sample=True)),
        F.error_feedback(C.top_k(0.5, per_sample=True)),
    ),
    "quantize4": pipeline.link(
        C.quantize(4, scale="feature"), C.quantize(4, rounding="stochastic")
    ),
    # one link per boundary: EF21 from the first stage to the middle one, the shared mask from
    # the middle stage to the last (two links' runs in one program)
    "ef21_bf16+shared_mask": (
        pipeline.link(F.ef21(C.top_k(0.25)), F.ef21(C.cast("bfloat16"))),
        pipeline.link(C.top_k(0.25, per_sample=True), mode="shared_mask"),
    ),
    "aq_sgd": pipeline.link(
        F.aq_sgd(C.quantize(4), N), F.error_feedback(C.top_k(0.5), num_samples=N)
    ),
}
# AQ-SGD's first step is its uncompressed warm-up, which fills both per-sample caches
SCHEDULES = {"aq_sgd": (False, True, True)}


def _max_diff(a, b):
    return max(
        (float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
         zip(jax.tree.leaves(a), jax.tree.leaves(b))),
        default=0.0,
    )  # fmt: skip


#: the runs whose link, MLP, keys and compress schedule are a test_golden.py case: their
#: numbers are compared with the recorded ones here too (the case's programs compiled once)
GOLDEN_CASES = {("aq_sgd", "1f1b"): "aq_sgd", ("quantize4", "1f1b"): "quant_stochastic"}
#: one schedule per link: GPipe for EF21 and the shared mask (one run), 1F1B for the
#: per-sample state (EF, AQ-SGD's caches) and the stochastic quantizer. The other schedule's
#: numbers: under GPipe, the per-sample EF by test_golden.py's ``replicas_topk_ef`` (both
#: schedules), a stochastic quantizer == the simulation by test_ticks.py's heterogeneous
#: payloads (both schedules), AQ-SGD's caches filled row by row by test_cold_sends.py (a GPipe
#: run on a data x stage mesh); under 1F1B, EF21 and the shared mask by test_golden.py
#: (ef21_q8, shared_mask), their payload sends by tests/export/test_pipeline.py (shared_mask)
RUNS = [("ef21_bf16+shared_mask", "gpipe")] + [
    (n, "1f1b") for n in ("aq_sgd", "quantize4", "topk_ef")
]
#: the fast tier's run (every other in the slow tier)
FAST_RUN = ("topk_ef", "1f1b")


@pytest.mark.parametrize(
    "name, schedule",
    [r if r == FAST_RUN else pytest.param(*r, marks=pytest.mark.slow) for r in RUNS],
)
def test_distributed_equals_simulated_and_sends_theory_bytes(
    name, schedule, mlp3, stage_mesh3, pack, tools, recorded
):
    mlp, stage_mesh = mlp3, stage_mesh3  # a first, a middle and a last stage: every role
    config = pipeline.PipelineConfig(mlp.M, LINKS[name], schedule=schedule)
    pipe = pipeline.distribute(mlp.model, config, stage_mesh)
    sim = pipeline.simulate(mlp.model, config)
    step = jax.jit(pipe.step, static_argnames="compress")
    sim_step = jax.jit(sim.step, static_argnames="compress")
    params, packed = mlp.params, pack(mlp.params, stage_mesh)
    states, sim_states = pipe.init(packed, mlp.batch), sim.init(params, mlp.batch)
    tools.close(states, sim_states, rtol=0, atol=0)
    compiled = {}  # one compile per program, both run and metered
    for i, compress in enumerate(SCHEDULES.get(name, (True, True))):
        key = jax.random.key(i)
        if compress not in compiled:
            compiled[compress] = step.lower(packed, mlp.batch, states, key, compress).compile()
            _check_bytes(compiled[compress], pipe, sim, params, mlp.batch, compress, stage_mesh)
        loss, grads, new_states, metrics = compiled[compress](packed, mlp.batch, states, key)
        s_loss, s_grads, s_states, s_metrics = sim_step(
            params, mlp.batch, sim_states, key, compress=compress
        )
        np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
        tools.close(grads.unpack(), s_grads)
        tools.close(new_states, s_states)
        assert metrics["wire_bytes"] == s_metrics["wire_bytes"]
        if (name, schedule) in GOLDEN_CASES:
            recorded.check(GOLDEN_CASES[name, schedule], i, loss, grads, new_states)
        if jax.tree.leaves(states):
            assert _max_diff(new_states, states) > 0
        _assert_mirrors(new_states)
        states, sim_states = new_states, s_states


def _check_bytes(compiled, pipe, sim, params, batch, compress, stage_mesh):
    """The program's sends, read from its compiled HLO, are the theoretical payload bytes, in
    each direction."""
    counts = pipe.bytes_per_step(params, batch, compress=compress)
    assert counts == sim.bytes_per_step(params, batch, compress=compress)
    text = compiled.as_text()
    report = comm.collective_report(text)
    sent = _links.hlo_sent_bytes(text, stage_mesh)
    assert sent["forward"] == counts["forward_bytes"]
    assert sent["backward"] == counts["backward_bytes"]
    by_kind = report.bytes_by_kind()
    by_kind.pop("collective-permute")
    # the loss, and with per-sample buffers a compressed step's cold_sends in the same
    # reduction (the seen flags stay local): no dense fallback anywhere
    cold = compress and any(n.startswith("seen[") for n in sim.init(params, batch).buffers)
    assert by_kind == {"all-reduce": 4.0 + 4.0 * cold}
    if compress:
        assert counts["wire_bytes"] < counts["dense_bytes"]
    else:
        assert counts["wire_bytes"] == counts["dense_bytes"]
        assert report.dtypes("collective-permute") == {"f32"}


def _assert_mirrors(states):
    """EF21 / AQ-SGD: each receiver's estimate is bit-identical to its sender's, in both
    directions (forward: held by stages b -> b + 1, backward: b + 1 -> b)."""
    for st in states.ends():
        for ends in (st.forward, st.backward):
            if hasattr(ends.send, "estimate"):
                np.testing.assert_array_equal(
                    np.asarray(ends.send.estimate), np.asarray(ends.recv.estimate)
                )


def test_aq_sgd_warmup_fills_both_caches(mlp3):
    """After the uncompressed warm-up, sender and receiver caches hold every sample's
    activation (in float16), bit-identical at both ends of each boundary."""
    mlp = mlp3
    config = pipeline.PipelineConfig(mlp.M, LINKS["aq_sgd"])
    sim = pipeline.simulate(mlp.model, config)
    states = sim.init(mlp.params, mlp.batch)
    _, _, states, _ = jax.jit(sim.step, static_argnames="compress")(
        mlp.params, mlp.batch, states, None, compress=False
    )
    h = mlp.batch["x"]
    for b, st in enumerate(states.ends()):
        h = mlp.model.stages[b](mlp.params[b], h)
        sent = np.asarray(st.forward.send.estimate)
        got = np.asarray(st.forward.recv.estimate)
        np.testing.assert_array_equal(sent, got)
        np.testing.assert_allclose(sent, np.asarray(h, np.float16), rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # the fast tier: identity links with a data axis (test_gpipe.py)
def test_data_replicas_equal_per_replica_simulations(tools):
    """With a data axis, replica r runs the simulation of its half batch with key
    fold_in(key, r); gradients are their mean, link states are per replica."""
    mlp = tools.make_mlp(num_microbatches=3, microbatch=4, num_stages=3)
    mesh = pipeline.pipeline_mesh(3, jax.devices()[:6])  # 2 x 3
    config = pipeline.PipelineConfig(mlp.M, LINKS["topk_ef"])
    pipe, sim = pipeline.distribute(mlp.model, config, mesh), pipeline.simulate(mlp.model, config)
    states = pipe.init(mlp.params, mlp.batch)
    key = jax.random.key(3)
    loss, grads, states, _ = jax.jit(pipe.step)(mlp.params, mlp.batch, states, key)
    half = mlp.batch["x"].shape[0] // 2
    sim_step = jax.jit(sim.step)
    outs = []
    for r in range(2):
        part = {k: v[r * half : (r + 1) * half] for k, v in mlp.batch.items()}
        outs.append(sim_step(mlp.params, part, sim.init(mlp.params, part),
                             jax.random.fold_in(key, r)))  # fmt: skip
    np.testing.assert_allclose(loss, (outs[0][0] + outs[1][0]) / 2, rtol=1e-5)
    tools.close(list(grads), jax.tree.map(lambda a, b: (a + b) / 2, outs[0][1], outs[1][1]))
    for r in range(2):
        tools.close(jax.tree.map(lambda a, r=r: a[:, r], states), outs[r][2])


EVAL_CODEC = C.quantize(2, rounding="stochastic")


@functools.cache
def _evaluation_by_hand(stages):
    """The stages with ``EVAL_CODEC`` at each boundary, microbatch ``m`` crossing boundary ``b``
    with ``fold_in(fold_in(fold_in(key, b), m), 0)``: one jitted program (op by op it compiled
    ~30 programs per run)."""

    def run(params, xs, key):
        out = []
        for m in range(xs.shape[0]):
            h = xs[m]
            for b in range(len(stages) - 1):
                h = stages[b](params[b], h)
                k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, b), m), 0)
                h = EVAL_CODEC.decompress(EVAL_CODEC.compress(h, EVAL_CODEC.init(h), k)[0], h)
            out.append(stages[-1](params[-1], h))
        return jnp.concatenate(out)

    return jax.jit(run)


@pytest.mark.slow
def test_compressed_evaluation_applies_each_forward_codec_with_the_documented_keys(
    mlp3, stage_mesh3, pack, tools
):
    """Compressed evaluation = the stages with each boundary's forward codec alone (no
    feedback), microbatch m crossing boundary b with fold_in(fold_in(fold_in(key, b), m), 0):
    checked against that computation written out, for gpipe and simulate. Only the forward
    payloads travel."""
    mlp, stage_mesh = mlp3, stage_mesh3
    config = pipeline.PipelineConfig(
        mlp.M, pipeline.link(F.error_feedback(EVAL_CODEC), C.quantize(8))
    )
    pipe, sim = (
        pipeline.distribute(mlp.model, config, stage_mesh),
        pipeline.simulate(mlp.model, config),
    )
    key = jax.random.key(11)
    params = mlp.params
    xs = np.asarray(mlp.batch["x"]).reshape(mlp.M, -1, mlp.batch["x"].shape[-1])
    expected = np.asarray(_evaluation_by_hand(mlp.model.stages)(params, xs, key))

    packed = pack(params, stage_mesh)
    compiled = (
        jax.jit(pipe.evaluate, static_argnames="compress")
        .lower(packed, mlp.batch, key, compress=True)
        .compile()
    )
    loss, metrics, out = compiled(packed, mlp.batch, key)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
    s_loss, _, s_out = jax.jit(sim.evaluate, static_argnames="compress")(
        params, mlp.batch, key, compress=True
    )
    np.testing.assert_allclose(np.asarray(s_out), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
    forward_only = pipe.bytes_per_step(params, mlp.batch, compress=True, train=False)
    assert metrics["wire_bytes"] == forward_only["wire_bytes"] < forward_only["dense_bytes"]
    sent = _links.hlo_sent_bytes(compiled.as_text(), stage_mesh)
    assert sent["forward"] == forward_only["wire_bytes"] == forward_only["forward_bytes"]
    assert sent["backward"] == 0

    dense_loss, _, dense_out = jax.jit(sim.evaluate)(params, mlp.batch)  # compress=False
    assert not np.allclose(np.asarray(out), np.asarray(dense_out))
    ref_loss, _ = tools.reference(mlp.model, mlp.params, mlp.batch)
    np.testing.assert_allclose(dense_loss, ref_loss, rtol=1e-5)


@pytest.mark.slow
def test_per_sample_buffers_are_updated_in_place_and_cost_their_live_size(mlp3, stage_mesh3, pack):
    """AQ-SGD caches (forward) and per-sample EF residuals (backward) hold one row per sample
    of the dataset; a step touches only its rows, so its scratch memory must not scale with
    them (no whole-buffer copy per send, nor per step). Each device stores only the ends it
    owns: its share of the link states is its live size (a middle stage holds two caches and
    one residual), not a slot of every boundary's."""
    mlp, stage_mesh = mlp3, stage_mesh3
    num_samples = 1 << 16
    cache_bytes = num_samples * 16 * 2  # [N, width] float16
    link = pipeline.link(
        F.aq_sgd(C.quantize(4), num_samples),
        F.error_feedback(C.quantize(8), num_samples=num_samples),
    )
    config = pipeline.PipelineConfig(mlp.M, link, schedule="1f1b")
    for pipe, params in (
        (pipeline.distribute(mlp.model, config, stage_mesh), pack(mlp.params, stage_mesh)),
        (pipeline.simulate(mlp.model, config), mlp.params),
    ):
        states = pipe.init(params, mlp.batch)
        compiled = (
            jax.jit(pipe.step, donate_argnums=2)
            .lower(params, mlp.batch, states, jax.random.key(0))
            .compile()
        )
        assert compiled.memory_analysis().temp_size_in_bytes < cache_bytes / 2
    memory = pipe.memory(params, mlp.batch)
    live = memory["live_link_state_bytes"]
    assert live[1] == 2 * cache_bytes + 2 * cache_bytes  # 2 caches, f32 residual
    assert live[0] == cache_bytes and live[2] == cache_bytes + 2 * cache_bytes
    distributed = pipeline.distribute(mlp.model, config, stage_mesh).init(
        pack(mlp.params, stage_mesh), mlp.batch
    )
    per_device = sum(b.addressable_shards[0].data.nbytes for b in distributed.buffers.values())
    # plus each device's seen flags: one byte per sample (uint8[N, 1], pipeline._link_state)
    assert per_device == memory["link_state_bytes"] == max(live) + num_samples
