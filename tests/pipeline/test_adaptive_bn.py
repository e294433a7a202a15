"""A BatchNorm stage model on adaptive pipeline links: the running statistics thread across a
mode switch as through fixed links, only real microbatches update them, and a resume from a
checkpoint taken after the switch is bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp import train
from jaxcomp.models import _norm

L, H = pipeline.LOW_COMPRESSION, pipeline.HIGH_COMPRESSION
S, M, MB, F = 3, 4, 4, 8  # M > S: GPipe has bubble ticks; a first, a middle and a last stage
STEPS, SAVE_AFTER = 5, 3
STEP_ARGS = ("compress", "modes")


def _bn_model():
    """Stages ``tanh(BN(x @ w))`` (the models' BatchNorm); the state also counts forwards."""
    bn, bn_eval = _norm.batch_norm(train=True), _norm.batch_norm(train=False)

    def stage(p, st, x):
        y, new = bn.apply(
            {"params": p["bn"], "batch_stats": st["bn"]}, x @ p["w"], mutable=["batch_stats"]
        )
        return jnp.tanh(y), {"bn": new["batch_stats"], "count": st["count"] + 1.0}

    def evaluate(p, st, x):
        return jnp.tanh(bn_eval.apply({"params": p["bn"], "batch_stats": st["bn"]}, x @ p["w"]))

    def loss(y, labels):
        return jnp.mean((y - labels) ** 2)

    return pipeline.StagedModel((stage,) * S, loss, stateful=True, eval_stages=(evaluate,) * S)


def _setup():
    rng = np.random.default_rng(0)
    params = [
        {
            "w": jnp.asarray(rng.normal(size=(F, F)) / np.sqrt(F), jnp.float32),
            "bn": {"scale": jnp.ones((F,)), "bias": jnp.zeros((F,))},
        }
        for _ in range(S)
    ]
    state = [
        {"bn": {"mean": jnp.zeros((F,)), "var": jnp.ones((F,))}, "count": jnp.zeros(())}
        for _ in range(S)
    ]
    batch = {
        "x": jnp.asarray(3.0 * rng.normal(size=(M * MB, F)) + 1.0, jnp.float32),
        "label": jnp.asarray(rng.normal(size=(M * MB, F)), jnp.float32),
    }
    return params, state, batch


# stateless channels, so fixed links run piece by piece are an exact reference
LOW = pipeline.link(C.quantize(8), C.quantize(8))
HIGH = pipeline.link(C.quantize(4), C.quantize(4))


def _stats(states):
    return [states.model_state(s) for s in range(S)]


@pytest.mark.slow
def test_batchnorm_statistics_on_adaptive_links_switch_count_and_resume(
    stage_mesh3, pack, tmp_path
):
    stage_mesh = stage_mesh3
    model = _bn_model()
    params, state0, batch = _setup()
    # interval 1, checked every step: the first check is critical (low); then the same batch
    # and parameters give norms that change only by the links' coding, far below eta = 8
    # (with the default 0.5, at S = 3, M = 4, boundary 0's backward norm with 4-bit links
    # moved enough from the 8-bit one's to go back to low at step 3): every link switches to
    # high compression at step 2 and stays
    det = pipeline.Detector(1, check_every=1, eta=8.0)
    config = pipeline.PipelineConfig(M, pipeline.adaptive_link(LOW, HIGH), detector=det)
    pipe = pipeline.distribute(model, config, stage_mesh)
    step = jax.jit(pipe.step, static_argnames=STEP_ARGS)
    packed = pack(params, stage_mesh)
    states = pipe.init(packed, batch, state0)
    modes, losses = [], []
    for t in range(STEPS):
        modes.append(pipeline.link_modes(states))
        loss, _, states, metrics = step(packed, batch, states, None, modes=modes[-1])
        assert int(metrics["modes_mismatch"]) == 0
        losses.append(float(loss))
        if t + 1 == SAVE_AFTER:
            ckpt = train.Checkpointer(str(tmp_path))
            ckpt.save(SAVE_AFTER, states, {"step": SAVE_AFTER})
            ckpt.wait()
            ckpt.close()
    assert modes == [((L, L),) * (S - 1)] * 2 + [((H, H),) * (S - 1)] * 3, modes

    # only real microbatches update the statistics: M forwards per step at every stage
    for s, st in enumerate(_stats(states)):
        assert float(st["count"]) == STEPS * M, (s, st["count"])

    # the statistics thread across the switch as through fixed low then fixed high links
    ref_states = None
    ref_losses = []
    for links, steps in ((LOW, 2), (HIGH, 3)):
        sim = pipeline.simulate(model, pipeline.PipelineConfig(M, links))
        start = state0 if ref_states is None else _stats(ref_states)
        ref_states = sim.init(params, batch, start)
        sim_step = jax.jit(sim.step)
        for _ in range(steps):
            loss, _, ref_states, _ = sim_step(params, batch, ref_states)
            ref_losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(_stats(states), _stats(ref_states), strict=True):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    mean0 = np.asarray(_stats(states)[0]["bn"]["mean"])
    assert not np.allclose(mean0, 0.0)  # updated (stage 0 sees the raw inputs, mean ~1)

    # resume from the checkpoint after step 3 (mid high-compression run): bit-identical
    ckpt = train.Checkpointer(str(tmp_path))
    restored_step, resumed, _ = ckpt.restore_latest(states)
    ckpt.close()
    assert restored_step == SAVE_AFTER and pipeline.link_modes(resumed) == ((H, H),) * (S - 1)
    for _ in range(STEPS - SAVE_AFTER):
        _, _, resumed, _ = step(packed, batch, resumed, None, modes=pipeline.link_modes(resumed))
    a, b = jax.tree.leaves(states), jax.tree.leaves(resumed)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
