"""Accordion on pipeline links: the detector decides as transforms.accordion does, modes follow
scripted norms, bytes follow the modes (HLO == theory per program), distributed == simulate,
the shared error-feedback state across a switch, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import pipeline
from jaxcomp import transforms
from jaxcomp.pipeline import _adaptive
from jaxcomp.pipeline import _links

L, H = pipeline.LOW_COMPRESSION, pipeline.HIGH_COMPRESSION
STEP_ARGS = ("compress", "modes")


def _ef_link(bits):
    return pipeline.link(F.error_feedback(C.quantize(bits)), F.error_feedback(C.quantize(bits)))


EF_ADAPTIVE = pipeline.adaptive_link(_ef_link(8), _ef_link(4))


# ----------------------------------------------------------------------------------------------
# The detector alone, against transforms.accordion on the same norm sequence


def _transform_modes(norms, interval_steps, check_every, schedule):
    """The mode transforms.accordion uses at each step for a [8, 8] gradient of norm n_t."""
    tx = transforms.accordion(
        C.quantize(8), C.quantize(4), interval_steps=interval_steps, check_every=check_every,
        learning_rate=schedule, axis_name=None, min_compression_rate=0,
    )  # fmt: skip
    g0 = jnp.ones((8, 8)) / 8.0  # unit norm
    state = tx.init({"w": g0})
    update = jax.jit(tx.update)
    used = []
    for t, n in enumerate(norms):
        after = int(transforms.accordion_metrics(state)["modes"]["w"])
        drop = t > 0 and schedule(t) < schedule(t - 1)
        used.append(L if drop else after)  # the transform's learning-rate switch at step t
        _, state = update({"w": g0 * n}, state)
    return used


def _detector_modes(norms, interval_steps, check_every, schedule, boundaries=2):
    """The modes the pipeline's detector gives when every sender sent norm n_t at step t."""
    det = pipeline.Detector(interval_steps, check_every, learning_rate=schedule)
    mask = ((True, True),) * boundaries
    adaptive = _adaptive.Adaptive((None,) * boundaries, (None,) * boundaries, mask, det)
    state = _adaptive.initial_detector_state(boundaries)
    update = jax.jit(lambda s, x: _adaptive.update_detector(adaptive, s, x))
    acc, used = jnp.zeros((boundaries, 2)), []
    for n in norms:
        used.append(np.asarray(state.mode))
        acc = acc + jnp.float32(n) ** 2
        state = update(state, acc)
        acc = jnp.where(state.count % interval_steps == 0, 0.0, acc)
    return used


# checks at even steps: first (low), same (high), x3 (low), +3% (high), NaN (low, and the next
# check compares with NaN: low), same twice (high), then the learning-rate drop at step 14
NORMS = [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.1, 3.0, np.nan, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("scale", [1e-10, 1.0, 1e6])
def test_detector_decides_as_transforms_accordion(scale):
    """Same decisions as the data-parallel Accordion on the same norm sequence (interval of 1
    step, checked every 2, a learning-rate drop at step 14, a NaN interval), at any scale."""
    schedule = optax.piecewise_constant_schedule(0.1, {14: 0.1})
    norms = [n * scale for n in NORMS]
    expected = _transform_modes(norms, 1, 2, schedule)
    got = _detector_modes(norms, 1, 2, schedule)
    assert all((g == e).all() for g, e in zip(got, expected)), (got, expected)
    assert expected == [L] * 3 + [H] * 2 + [L] * 2 + [H] * 2 + [L] * 4 + [H, L, H]


# ----------------------------------------------------------------------------------------------
# Through the pipeline: scripted activation / gradient norms


def _identity_model(num_stages=4):
    def stage(w, x):
        return x * w

    def loss(y, t):
        return jnp.mean(y * t)

    return pipeline.StagedModel((stage,) * num_stages, loss)


@pytest.fixture(scope="module")
def scripted():
    model = _identity_model()
    rng = np.random.default_rng(1)
    params = [jnp.ones((8,), jnp.float32)] * 4
    x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    labels = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    lk = pipeline.adaptive_link(
        pipeline.link(C.quantize(8), C.quantize(8)), pipeline.link(C.quantize(4), C.quantize(4))
    )
    schedule = optax.piecewise_constant_schedule(0.1, {7: 0.1})
    det = pipeline.Detector(2, check_every=1, learning_rate=schedule)
    sim = pipeline.simulate(model, pipeline.PipelineConfig(4, lk, detector=det))
    return sim, params, x, labels


def test_modes_follow_scripted_norms_and_bytes_follow_modes(scripted):
    """Intervals of 2 steps, checked at every interval end. Forward norms scale with the
    inputs (c_t), backward norms with the labels (d_t); the learning rate drops at step 7."""
    sim, params, x, labels = scripted
    c = [1, 1, 1, 1, 3, 3, 3, 3, 3, 3.1]
    d = [1, 1, 1, 1, 1, 1, 1, 1, 5, 5]
    expected = [(L, L)] * 4 + [(H, H)] * 2 + [(L, H), (L, L), (H, H), (H, H)]
    step = jax.jit(sim.step, static_argnames=STEP_ARGS)
    states = sim.init(params, {"x": x, "label": labels})
    bytes_by_mode = {}
    for t in range(len(c)):
        modes = pipeline.link_modes(states)
        assert modes == ((expected[t],) * 3), (t, modes)
        batch = {"x": x * c[t], "label": labels * d[t]}
        _, _, states, metrics = step(params, batch, states, None, modes=modes)
        counts = sim.bytes_per_step(params, batch, modes=modes)
        assert float(metrics["wire_bytes"]) == counts["wire_bytes"]
        assert np.asarray(metrics["link_modes"]).tolist() == [list(expected[t])] * 3
        bytes_by_mode[expected[t]] = counts["wire_bytes"]
        if t % 2 == 1:  # an interval end: the statistic is the norm of what was sent
            fwd = np.sqrt(c[t - 1] ** 2 + c[t] ** 2) * np.linalg.norm(np.asarray(x))
            g = np.asarray(labels) / (2 * 8) / 4  # d mean(y t) / dy of a microbatch, / M
            bwd = np.sqrt(d[t - 1] ** 2 + d[t] ** 2) * np.linalg.norm(g)
            norm = np.asarray(states.adaptive.norm)
            np.testing.assert_allclose(norm[0, 0], fwd, rtol=1e-5)  # sent exactly by stage 0
            np.testing.assert_allclose(norm[2, 1], bwd, rtol=1e-5)  # and by the last stage
    assert pipeline.link_modes(states) == (((H, L),) * 3)
    lo, hi, mixed = bytes_by_mode[(L, L)], bytes_by_mode[(H, H)], bytes_by_mode[(L, H)]
    assert hi < mixed < lo  # 4-bit vs 8-bit payloads
    # without modes, evaluation and byte counts take every boundary's low link (as documented)
    low = ((L, L),) * 3
    for train in (True, False):
        assert sim.bytes_per_step(params, batch, train=train) == sim.bytes_per_step(
            params, batch, train=train, modes=low
        )
    assert np.isfinite(float(sim.evaluate(params, batch, compress=True)[0]))


@pytest.fixture(scope="module")
def ef_adaptive(mlp3):
    """EF_ADAPTIVE on the 3-stage MLP under 1F1B, detector interval 1: the config and the
    simulation's jitted step (shared: the simulation's programs compiled once per modes)."""
    det = pipeline.Detector(1, check_every=1)
    config = pipeline.PipelineConfig(mlp3.M, EF_ADAPTIVE, schedule="1f1b", detector=det)
    sim = pipeline.simulate(mlp3.model, config)
    return config, sim, jax.jit(sim.step, static_argnames=STEP_ARGS)


@pytest.mark.slow
def test_a_switch_keeps_the_error_feedback_residual(mlp3, ef_adaptive):
    """Low and high share the channel state: the first 4-bit step compensates the residual the
    8-bit steps left (x + e_old == x_hat + e_new for every microbatch, with the high codec)."""
    mlp = mlp3
    _, sim, step = ef_adaptive
    states = sim.init(mlp.params, mlp.batch)
    for _ in range(2):  # interval 0 is critical; the second step's norms barely change
        modes = pipeline.link_modes(states)
        assert modes[0] == (L, L)
        _, _, states, _ = step(mlp.params, mlp.batch, states, None, modes=modes)
    assert pipeline.link_modes(states)[0] == (H, H)
    old = states.ends()[0].forward.send.state.residual
    assert float(jnp.abs(old).max()) > 0  # the 8-bit steps left a residual
    _, _, states, _ = step(mlp.params, mlp.batch, states, None, modes=pipeline.link_modes(states))
    xs = mlp.batch["x"].reshape(mlp.M, -1, mlp.batch["x"].shape[-1])
    e = _high_residual(mlp.model.stages[0], mlp.params[0], xs, old)
    np.testing.assert_allclose(states.ends()[0].forward.send.state.residual, e, atol=1e-6)


@functools.partial(jax.jit, static_argnums=0)
def _high_residual(stage, params, xs, e):
    """The residual after stage ``stage``'s microbatches ``xs`` crossed the 4-bit error-feedback
    codec from residual ``e`` (one program: op by op it compiled ~40)."""
    codec = C.quantize(4)
    for m in range(xs.shape[0]):
        v = stage(params, xs[m]) + e
        payload, _ = codec.compress(v, codec.init(v), None)
        e = v - codec.decompress(payload, v)
    return e


# ----------------------------------------------------------------------------------------------
# Distributed == simulate, and each program's HLO bytes == its theory


@pytest.mark.slow
def test_distributed_equals_simulate_and_each_program_sends_its_theory(
    mlp3, stage_mesh3, pack, tools, ef_adaptive
):
    mlp, stage_mesh = mlp3, stage_mesh3  # the detector's statistics of a middle stage too
    config, sim, sim_step = ef_adaptive
    pipe = pipeline.distribute(mlp.model, config, stage_mesh)
    step = jax.jit(pipe.step, static_argnames=STEP_ARGS)
    packed = pack(mlp.params, stage_mesh)
    states, sim_states = pipe.init(packed, mlp.batch), sim.init(mlp.params, mlp.batch)
    seen = []
    for _ in range(3):
        modes = pipeline.link_modes(states)
        assert modes == pipeline.link_modes(sim_states)
        seen.append(modes)
        loss, grads, states, metrics = step(packed, mlp.batch, states, None, modes=modes)
        s_loss, s_grads, sim_states, _ = sim_step(mlp.params, mlp.batch, sim_states, None,
                                                  modes=modes)  # fmt: skip
        np.testing.assert_allclose(loss, s_loss, rtol=1e-5)
        tools.close(grads.unpack(), s_grads, rtol=1e-4, atol=1e-6)
        tools.close(states.buffers, sim_states.buffers, rtol=1e-4, atol=1e-5)
        tools.close(states.adaptive, sim_states.adaptive, rtol=1e-5, atol=0)
        assert int(metrics["modes_mismatch"]) == 0
    assert seen[0] != seen[-1]  # the run switched: both programs ran
    num = mlp.model.num_stages
    for modes in (seen[0], seen[-1], ((H, L), (L, H))):
        compiled = step.lower(packed, mlp.batch, states, None, modes=modes).compile()
        counts = pipe.bytes_per_step(packed, mlp.batch, modes=modes)
        text = compiled.as_text()
        sent = _links.hlo_sent_bytes(text, stage_mesh)
        by_kind = comm.collective_report(text).bytes_by_kind()
        assert sent["forward"] == counts["forward_bytes"], modes
        assert sent["backward"] == counts["backward_bytes"], modes
        by_kind.pop("collective-permute")
        # the loss and the detector's 2 (S - 1) float32 statistics: nothing else
        assert by_kind == {"all-reduce": 4.0 + 4.0 * 2 * (num - 1)}, by_kind


def test_bubble_ticks_do_not_touch_the_detector_statistic(mlp3, stage_mesh3, pack):
    """M = S (the most bubble ticks) under 1F1B: each sender's accumulated squared norm is
    exactly the sum over the M real microbatches it sent (identity low links)."""
    mlp = mlp3
    lk = pipeline.adaptive_link(pipeline.link(), pipeline.link(C.quantize(4), C.quantize(4)))
    det = pipeline.Detector(100)
    config = pipeline.PipelineConfig(mlp.M, lk, schedule="1f1b", detector=det)
    pipe = pipeline.distribute(mlp.model, config, stage_mesh3)
    packed = pack(mlp.params, stage_mesh3)
    states = pipe.init(packed, mlp.batch)
    _, _, states, _ = jax.jit(pipe.step, static_argnames=STEP_ARGS)(
        packed, mlp.batch, states, None, modes=pipeline.link_modes(states)
    )

    def boundary_values(hs):  # activations at each boundary; their loss gradients
        h, out = hs, []
        for f, p in zip(mlp.model.stages[:-1], mlp.params[:-1]):
            h = f(p, h)
            out.append(h)
        return out

    acts = boundary_values(mlp.batch["x"])

    def loss_from(b, h):
        for f, p in zip(mlp.model.stages[b + 1 :], mlp.params[b + 1 :]):
            h = f(p, h)
        return mlp.model.loss_fn(h, mlp.batch["label"])

    for b, end in enumerate(states.ends()):
        fwd = float(np.sum(np.square(np.asarray(acts[b]))))
        g = jax.grad(lambda h, b=b: loss_from(b, h))(acts[b])
        bwd = float(np.sum(np.square(np.asarray(g))))
        np.testing.assert_allclose(float(end.forward.send.norm_sq), fwd, rtol=1e-5)
        np.testing.assert_allclose(float(end.backward.send.norm_sq), bwd, rtol=1e-5)
    assert int(states.adaptive.count) == 1 and pipeline.link_modes(states)[0] == (L, L)


# ----------------------------------------------------------------------------------------------
# Errors


def test_adaptive_link_errors_are_named(mlp):
    plain8 = pipeline.link(C.quantize(8), C.quantize(8))
    mixed = pipeline.adaptive_link(_ef_link(8), pipeline.link(C.quantize(4), C.quantize(4)))
    det = pipeline.Detector(1)
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, mixed, detector=det))
    with pytest.raises(ValueError, match=r"links\[0\]: the low .* forward channels keep different"):
        sim.init(mlp.params, mlp.batch)
    with pytest.raises(TypeError, match="PipelineConfig.detector must be a pipeline.Detector"):
        pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, EF_ADAPTIVE))
    with pytest.raises(ValueError, match="detector is set but no link is adaptive"):
        pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, plain8, detector=det))
    with pytest.raises(ValueError, match="nothing would switch"):
        pipeline.simulate(
            mlp.model,
            pipeline.PipelineConfig(mlp.M, pipeline.adaptive_link(plain8, plain8), detector=det),
        )
    with pytest.raises(ValueError, match="same backward mode"):
        pipeline.adaptive_link(plain8, pipeline.link(C.top_k(0.5), mode="shared_mask"))
    with pytest.raises(ValueError, match="detector.eta must be a number > 0"):
        pipeline.simulate(
            mlp.model,
            pipeline.PipelineConfig(mlp.M, EF_ADAPTIVE, detector=pipeline.Detector(1, eta=0)),
        )
    sim = pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, EF_ADAPTIVE, detector=det))
    states = sim.init(mlp.params, mlp.batch)
    with pytest.raises(ValueError, match="pass modes=pipeline.link_modes"):
        jax.jit(sim.step)(mlp.params, mlp.batch, states)
    with pytest.raises(ValueError, match="modes must be 3 pairs"):
        sim.step(mlp.params, mlp.batch, states, modes=((0, 0),))
    fixed = pipeline.simulate(mlp.model, pipeline.PipelineConfig(mlp.M, plain8))
    with pytest.raises(ValueError, match="carry an adaptive-link detector state"):
        fixed.step(mlp.params, mlp.batch, states)
    # modes that are not the state's: a NaN step that says so, never a silent one
    wrong = ((H, H),) * 3
    loss, grads, _, metrics = jax.jit(sim.step, static_argnames=STEP_ARGS)(
        mlp.params, mlp.batch, states, None, modes=wrong
    )
    assert int(metrics["modes_mismatch"]) == 1 and np.isnan(float(loss))
    assert all(np.isnan(np.asarray(g)).all() for g in jax.tree.leaves(grads))
