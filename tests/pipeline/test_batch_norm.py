"""BatchNorm in the pipeline: running statistics as per-stage state, threaded through GPipe,
1F1B and the simulation, updated by real microbatches only and in microbatch order; per-replica
and synchronised statistics with data replicas; evaluation with the running statistics (the
trainer's resume: tests/train/test_resume.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import models
from jaxcomp import pipeline
from jaxcomp.models import _staged
from jaxcomp.train import _mode

M, MB, S = 3, 4, 3


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _close(got, want, rtol=1e-5, atol=1e-6):
    got, want = _leaves(got), _leaves(want)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def _sequential(model, params, state, x, labels, m_):
    """The unpipelined model applied microbatch by microbatch (running statistics chained):
    mean loss, mean gradient and the statistics after the last microbatch."""
    xs = x.reshape(m_, -1, *x.shape[1:])
    ys = labels.reshape(m_, -1)

    def body(st, xy):
        def loss(p):
            logits, new = model.apply(_mode.join_variables(p, st), xy[0], train=True)
            return _staged.cross_entropy(logits, xy[1]), _mode.split_variables(new)[1]

        (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return new, (value, grads)

    state, (values, grads) = jax.lax.scan(body, tuple(state), (xs, ys))
    return values.mean(), jax.tree.map(lambda g: g.mean(0), grads), state


def _stats(states, replica=0):
    return tuple(states.model_state(s, replica) for s in range(S))


@pytest.fixture(scope="module")
def resnet():
    # stem | layer1 | head: two stages with BatchNorm (one and two layers of it), one ({})
    # without: a first, a middle and a last stage
    model = models.resnet18(width=4, blocks=(1,), input_shape=(8, 8, 1), cuts=("stem", "layer1"))
    params, state = _mode.split_variables(_mode.jit_init(model.init)(jax.random.key(0)))
    rng = np.random.default_rng(0)
    n = 2 * M * MB  # two replicas' worth
    x = jnp.asarray(3.0 * rng.normal(size=(n, 8, 8, 1)) + 1.0, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 10, n), jnp.int32)
    return model, list(params), state, x, labels


@pytest.fixture(scope="module")
def reference(resnet):
    model, params, state, x, labels = resnet
    batch = {"x": x[: M * MB], "label": labels[: M * MB]}
    return batch, jax.jit(_sequential, static_argnums=(0, 5))(
        model, params, state, batch["x"], batch["label"], M
    )


@pytest.mark.slow
def test_the_simulation_equals_the_model_applied_microbatch_by_microbatch(resnet, reference):
    """The simulation (GPipe's order) against the model applied microbatch by microbatch. The
    distributed GPipe's statistics, gradient and evaluation: against the same model in
    test_synchronised_statistics_are_those_of_the_microbatch_concatenated_over_replicas (its
    own identity run compiled a third ResNet pipeline step); 1F1B's: equal to the simulation's
    (with replicas and compressed links, evaluation included) in
    test_data_replicas_keep_their_own_statistics_equal_to_the_simulation, updated in
    microbatch order in test_only_real_microbatches_update_the_state_in_microbatch_order."""
    model, params, state, _, _ = resnet
    batch, (loss, grads, stats) = reference
    pipe = pipeline.simulate(model, pipeline.PipelineConfig(M))
    states = pipe.init(params, batch, state)
    assert states.model["float32"].shape[0] == S  # per stage
    got_loss, got_grads, new, _ = jax.jit(pipe.step)(params, batch, states)
    np.testing.assert_allclose(float(got_loss), float(loss), rtol=1e-5)
    _close(got_grads, grads, rtol=2e-4, atol=2e-6)
    _close(_stats(new), stats)
    _check_evaluation(pipe, params, params, batch, new, model, _stats(new))


def _check_evaluation(pipe, p, params, batch, states, model, stats):
    """Evaluation normalises with the running statistics ``stats``; the head keeps none."""
    assert stats[-1] == {}
    _, _, logits = jax.jit(pipe.evaluate, static_argnames="compress")(p, batch, states=states)
    want, _ = jax.jit(model.apply)(_mode.join_variables(params, stats), batch["x"])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5)


def _counter_model():
    """Stages ``y = x * w`` whose state counts its forwards and folds in each microbatch's
    mean in order (``trace <- trace / 2 + mean(x)``); evaluation reads the state."""

    def stage(p, st, x):
        new = {"count": st["count"] + 1.0, "trace": st["trace"] / 2 + x.mean()}
        return x * p, new

    def evaluate(p, st, x):
        return x * p + st["trace"]

    def loss(y, labels):
        return jnp.mean((y - labels) ** 2)

    return pipeline.StagedModel((stage,) * S, loss, stateful=True, eval_stages=(evaluate,) * S)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_only_real_microbatches_update_the_state_in_microbatch_order(schedule):
    m_ = 6  # > S: bubble ticks, and 1F1B's steady state interleaves forwards and backwards
    model = _counter_model()
    params = [jnp.asarray(1.0 + 0.5 * s, jnp.float32) for s in range(S)]
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.normal(size=(m_ * 2, 3)), jnp.float32),
        "label": jnp.zeros((m_ * 2, 3), jnp.float32),
    }
    state = [{"count": jnp.zeros(()), "trace": jnp.zeros(())} for _ in range(S)]
    mesh = pipeline.pipeline_mesh(S, jax.devices()[:S])
    pipe = pipeline.distribute(model, pipeline.PipelineConfig(m_, schedule=schedule), mesh)
    states = pipe.init(params, batch, state)
    _, _, new, _ = jax.jit(pipe.step)(params, batch, states)
    h = np.asarray(batch["x"], np.float64).reshape(m_, 2, 3)
    for s in range(S):
        got = new.model_state(s)
        assert float(got["count"]) == m_  # one update per real forward, none from bubbles
        trace = 0.0
        for m in range(m_):
            trace = trace / 2 + h[m].mean()
        np.testing.assert_allclose(float(got["trace"]), trace, rtol=1e-5)
        h = h * float(params[s])
    for s in range(S):  # the step's input states are not modified in place
        assert float(states.model_state(s)["count"]) == 0.0


def _replica_batch(x, labels, r):
    half = M * MB
    return {"x": x[r * half : (r + 1) * half], "label": labels[r * half : (r + 1) * half]}


@pytest.mark.slow
def test_data_replicas_keep_their_own_statistics_equal_to_the_simulation(resnet):
    """2 replicas x 3 stages, TopK+EF forward links: each replica's statistics, link states
    and gradient equal the simulation on its half of the batch."""
    model, params, state, x, labels = resnet
    ef = feedback.error_feedback(compressors.top_k(0.25, per_sample=True))
    config = pipeline.PipelineConfig(M, pipeline.link(ef), schedule="1f1b")
    mesh = pipeline.pipeline_mesh(S, jax.devices()[: 2 * S])  # 2 replicas
    pipe = pipeline.distribute(model, config, mesh)
    packed = pipeline.pack_params(params, NamedSharding(mesh, P("stage")))
    batch = {"x": x, "label": labels}
    states = pipe.init(packed, batch, state)
    assert states.model["float32"].shape[:2] == (S, 2)
    loss, grads, new, _ = jax.jit(pipe.step)(packed, batch, states)
    sim = pipeline.simulate(model, config)
    want_loss, want_grads = 0.0, []
    for r in range(2):
        half = _replica_batch(x, labels, r)
        l_r, g_r, s_r, _ = jax.jit(sim.step)(params, half, sim.init(params, half, state))
        _close(_stats(new, r), _stats(s_r))
        _close(new.ends(r), s_r.ends(), rtol=1e-5, atol=1e-6)
        want_loss += float(l_r) / 2
        want_grads.append(g_r)
    assert not np.allclose(_leaves(_stats(new, 0)[0]), _leaves(_stats(new, 1)[0]))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    _close(grads.unpack(), jax.tree.map(lambda a, b: (a + b) / 2, *want_grads), 2e-4, 2e-6)
    # evaluation: replica 0's statistics, or the mean over replicas, for every replica
    for how, pick in (("replica0", lambda a, b: a), ("mean", lambda a, b: (a + b) / 2)):
        stats = jax.tree.map(pick, _stats(new, 0), _stats(new, 1))
        _, _, logits = jax.jit(pipe.evaluate, static_argnames=("compress", "stats"))(
            packed, batch, states=new, stats=how
        )
        want, _ = jax.jit(model.apply)(_mode.join_variables(params, stats), x)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_synchronised_statistics_are_those_of_the_microbatch_concatenated_over_replicas(resnet):
    """The distributed GPipe (2 replicas x 3 stages, statistics synchronised over ``data``)
    against the model applied microbatch by microbatch: statistics, gradient, evaluation."""
    model, params, state, x, labels = resnet
    config = pipeline.PipelineConfig(M)
    mesh = pipeline.pipeline_mesh(S, jax.devices()[: 2 * S])  # 2 replicas
    pipe = pipeline.distribute(model.with_batch_axis("data"), config, mesh)
    packed = pipeline.pack_params(params, NamedSharding(mesh, P("stage")))
    batch = {"x": x, "label": labels}
    loss, grads, new, _ = jax.jit(pipe.step)(packed, batch, pipe.init(packed, batch, state))
    # microbatch m of the synchronised pipeline: microbatch m of both replicas' halves
    order = np.arange(x.shape[0]).reshape(2, M, MB).transpose(1, 0, 2).reshape(-1)
    want_loss, want_grads, want_stats = jax.jit(_sequential, static_argnums=(0, 5))(
        model, params, state, x[order], labels[order], M
    )
    assert new.model["float32"].shape[:2] == (S, 2)  # per stage, on the stage's devices
    for r in range(2):
        _close(_stats(new, r), want_stats)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close(grads.unpack(), want_grads, rtol=2e-4, atol=2e-6)
    _check_evaluation(pipe, packed, params, batch, new, model, _stats(new))


def test_stateful_pipelines_name_a_missing_or_mismatched_state(resnet):
    model, params, state, x, labels = resnet
    batch = {"x": x[: M * MB], "label": labels[: M * MB]}  # no `reference`: its compile, ~2 s
    sim = pipeline.simulate(model, pipeline.PipelineConfig(M))
    with pytest.raises(ValueError, match="model is stateful"):
        sim.init(params, batch)
    states = sim.init(params, batch, state)
    with pytest.raises(ValueError, match="model is stateful"):
        sim.evaluate(params, batch)
    stateless = pipeline.simulate(
        pipeline.StagedModel(model.stages, model.loss_fn), pipeline.PipelineConfig(M)
    )
    with pytest.raises(ValueError, match="not stateful"):
        stateless.step(params, batch, states)
    with pytest.raises(ValueError, match="no running state"):
        stateless.init(params, batch, state)
    short = {g: b[:, :-1] for g, b in states.model.items()}  # e.g. a checkpoint of another model
    bad = pipeline.LinkStates(
        states.buffers, states.layout, states.replica, states.replica_layout,
        model=short, model_layout=states.model_layout,
    )  # fmt: skip
    with pytest.raises(ValueError, match="model state buffers"):
        sim.step(params, batch, bad)
    with pytest.raises(ValueError, match="eval_stages"):
        pipeline.StagedModel(model.stages, model.loss_fn, stateful=True)
    with pytest.raises(ValueError, match="stats must be one of"):
        sim.evaluate(params, batch, states=states, stats="replica1")
    with pytest.raises(ValueError, match="stateful_stage_fns"):
        model.stage_fns(train=True)
