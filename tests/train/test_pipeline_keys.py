"""The trainer's ``config.pipeline`` keys: ``schedule``, ``checkpoint`` and ``replica_mean`` reach
the pipeline, change nothing they should not, and reject bad values; AQ-SGD's warm-up fills
the per-sample caches, then compresses. Each step's gradient norm per stage
(``grad_norm/stage_<s>``): the stages' own entries, the padding of the packed rows left out,
with and without data replicas; in those runs against the SGD step's own update."""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import pipeline
from jaxcomp import train
from jaxcomp.train import _pipeline_mode
from jaxcomp.train import _trainer

#: 1F1B / checkpointing == GPipe to tolerances, bytes and keys: no bit of XLA's optimised programs
#: is pinned; compiled unoptimised (as tests/pipeline), the pipelined steps compile faster
pytestmark = pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")

POWER_SGD = {"transform": "compressed_mean", "codec": {"name": "power_sgd", "rank": 1}}


def _config(make_config, mesh=(("stage", 2),), **keys):
    """A 2-stage MLP, 2 microbatches: the smallest pipeline where 1F1B is not GPipe."""
    return make_config(
        mode="pipeline",
        mesh=list(mesh),
        model={"hidden": (16,)},
        batch_size=32,
        eval_batch_size=32,
        optax_name="sgd",
        lr=0.1,
        pipeline={
            "num_microbatches": 2,
            "forward": {"name": "quantize", "bits": 8},
            "backward": {"name": "quantize", "bits": 8},
            **keys,
        },
    )


@pytest.fixture
def built(monkeypatch):
    """The :class:`pipeline.PipelineConfig` of every pipeline the trainer builds."""
    configs = []
    distribute = pipeline.distribute

    def spy(model, config, mesh):
        configs.append(config)
        return distribute(model, config, mesh)

    monkeypatch.setattr(pipeline, "distribute", spy)
    return configs


def _key(s, i):
    return _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(i))), s.mesh)


def _one_step(config):
    """``(setup, metrics, params)`` after one training step from the seed-0 state; checks the
    step's gradient norms against its SGD update (``config.lr`` times the gradient)."""
    s = train.setup(config)
    state = s.mode.init(jax.random.key(0))
    before = [np.asarray(p, np.float64) for p in jax.tree.leaves(state.params)]
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    batch = _trainer.place(batch, s.mode.batch_sharding)
    state, metrics = s.mode.train_step(state, batch, _key(s, 1), 0)
    params = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    metrics = jax.device_get(metrics)
    _check_stage_norms(config, metrics, before, params)
    return s, metrics, params


def _check_stage_norms(config, metrics, before, after):
    """SGD's update is ``-lr g``: each stage's norm and the global one, from the update's rows
    (float32 parameters round the update: ~1e-5 of these norms)."""
    assert config.optax_name == "sgd" and not config.get("grad_clip_norm")
    rows = [(b - a) / config.lr for b, a in zip(before, after)]  # one [S, L] per dtype
    want = np.sqrt(sum(np.sum(r**2, axis=1) for r in rows))
    got = np.array([metrics[f"grad_norm/stage_{s}"] for s in range(len(want))])
    assert f"grad_norm/stage_{len(want)}" not in metrics
    np.testing.assert_allclose(got, want, rtol=1e-3)
    np.testing.assert_allclose(metrics["grad_norm"], np.sqrt(np.sum(got**2)), rtol=1e-6)
    assert all(g > 0 for g in got)


#: stage trees of float32 and bfloat16 leaves: every packed row but one has padding
STAGES = (
    {"w": np.arange(6, dtype=np.float32).reshape(3, 2) - 2.5, "h": np.array([3, -1], "bfloat16")},
    {"b": np.array([0.5], np.float32)},
    {"k": np.array([1, 2, 3, 4], np.float32), "h": np.array([2, 0, 1], "bfloat16")},
    {},
)


@functools.cache
def _stage_sums_on(axes):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: 2 * len(STAGES)]).reshape(2, -1), axes)
    fn = jax.jit(functools.partial(_pipeline_mode.stage_square_sums, mesh=mesh))
    return mesh, fn


@pytest.mark.parametrize("axes", [None, ("data", "stage")])
def test_stage_norms_count_each_stages_own_entries_only(axes):
    """With padding that is not zero (a compressed replica mean could leave some), on one
    device and with 2 data replicas of the stages (``axes``)."""
    packed = pipeline.pack_params([{k: jax.numpy.asarray(v) for k, v in t.items()} for t in STAGES])
    buffers = {g: np.array(b) for g, b in packed.buffers.items()}
    for g, b in buffers.items():
        for s, tree in enumerate(STAGES):
            b[s, sum(x.size for x in tree.values() if x.dtype == g) :] = 1e3
    want = [sum(np.sum(np.float64(x) ** 2) for x in t.values()) for t in STAGES]
    assert want[-1] == 0.0
    if axes is None:
        got = _pipeline_mode.stage_square_sums(pipeline.PackedParams(buffers, packed.layout))
    else:
        mesh, fn = _stage_sums_on(axes)
        placed = jax.device_put(buffers, NamedSharding(mesh, P("stage")))
        got = fn(pipeline.PackedParams(placed, packed.layout))
        assert got.sharding.is_fully_replicated
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.slow
def test_schedule_and_checkpoint_reach_the_pipeline_with_gpipes_numbers(make_config, built):
    _, gpipe_metrics, gpipe_params = _one_step(_config(make_config))
    # 1F1B without checkpointing: test_replica_mean_compresses_the_data_axis (a setup fewer)
    for keys in ({"schedule": "1f1b", "checkpoint": "dots_saveable"}, {"checkpoint": True}):
        s, metrics, params = _one_step(_config(make_config, **keys))
        got = built[-1]
        assert got.schedule == keys.get("schedule", "gpipe")
        assert got.checkpoint == keys.get("checkpoint")
        assert got.replica_mean is None
        assert s.mode.extra["schedule"] == got.schedule and got.schedule in s.mode.description
        np.testing.assert_allclose(metrics["loss"], gpipe_metrics["loss"], rtol=1e-6)
        for a, b in zip(params, gpipe_params):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert built[0].schedule == "gpipe" and built[0].checkpoint is None  # the defaults


@pytest.mark.slow
def test_replica_mean_compresses_the_data_axis(make_config, built):
    mesh = (("data", 2), ("stage", 2))
    plain, plain_metrics, _ = _one_step(_config(make_config, mesh, schedule="1f1b"))
    assert built[-1].replica_mean is None
    assert plain.mode.extra["replica_mean"] == "float32 pmean"
    dense = plain.mode.extra["data_dense_bytes_per_step"]
    assert plain_metrics["data_wire_bytes"] == dense  # a plain mean sends every float

    s, metrics, params = _one_step(_config(make_config, mesh, replica_mean=POWER_SGD))
    assert isinstance(built[-1].replica_mean, optax.GradientTransformation)
    assert "power_sgd" in s.mode.extra["replica_mean"]
    assert s.mode.extra["data_dense_bytes_per_step"] == dense
    assert 0 < metrics["data_wire_bytes"] < dense / 4
    assert metrics["finite"] == 1 and all(np.isfinite(p).all() for p in params)


@pytest.mark.slow
def test_aq_sgd_warm_up_fills_the_caches_then_compresses(make_config):
    config = _config(
        make_config,
        forward={"name": "quantize", "bits": 4, "scale": "feature", "feedback": "aq_sgd"},
        warmup_epochs=1,
    )
    s = train.setup(config)
    steps_per_epoch = s.train_loader.steps_per_epoch
    state = s.mode.init(jax.random.key(0))
    batch, _ = s.train_loader.next(s.train_loader.initial_state())
    place = functools.partial(_trainer.place, sharding=s.mode.batch_sharding)
    state, m0 = s.mode.train_step(state, place(batch), _key(s, 0), 0)  # warm-up: dense
    cache = np.asarray(state.link_states.ends()[0].forward.send.estimate)  # [samples, 16]
    filled = np.flatnonzero(np.abs(cache).sum(axis=1))
    np.testing.assert_array_equal(np.sort(filled), np.sort(batch["ids"]))
    state, m1 = s.mode.train_step(state, place(batch), _key(s, 1), steps_per_epoch)
    assert m0["finite"] == 1 and m1["finite"] == 1
    assert s.mode.wire_bytes < s.mode.dense_bytes
    # each step reports what it sent: the warm-up the dense bytes (it logged the compressed
    # run's figure, 904,512 for 1.50 MiB, in a study), the compressed steps the run's
    assert float(m0["wire_bytes"]) == s.mode.dense_bytes
    assert float(m1.get("wire_bytes", s.mode.wire_bytes)) == s.mode.wire_bytes
    # the warm-up filled every row the compressed step sends from (one per-sample sender)
    assert "cold_sends" not in m0 and float(m1["cold_sends"]) == 0


@pytest.mark.parametrize(
    "mesh, keys, error",
    [
        ((("stage", 2),), {"schedule": "1F1B"}, r"schedule must be one of \('gpipe', '1f1b'\)"),
        ((("stage", 2),), {"schedule": None}, r"schedule must be one of"),
        ((("stage", 2),), {"checkpoint": "sometimes"}, r"checkpoint must be None, True"),
        ((("stage", 2),), {"checkpoint": 2}, r"checkpoint must be None, True"),
        ((("stage", 2),), {"replica_mean": POWER_SGD}, r"needs the distributed pipeline .* 1 "
         r"replica"),
        ((("data", 2), ("stage", 2)), {"replica_mean": POWER_SGD, "simulate": True},
         r"replica_mean averages .*\(simulate=True"),
        ((("data", 2), ("stage", 2)), {"replica_mean": {"transfrom": "compressed_mean"}},
         r"unknown key\(s\) \['transfrom'\] in config.pipeline.replica_mean"),
        ((("data", 2), ("stage", 2)), {"replica_mean": {"transform": "mean_of_signs"}},
         r"replica_mean.transform must be one of .* got 'mean_of_signs'"),
        # accordion_batch_size changes the batch per update: not an average (was silently
        # taken as compressed_mean with the default codec)
        ((("data", 2), ("stage", 2)), {"replica_mean": {"transform": "accordion_batch_size"}},
         r"replica_mean.transform must be one of \('compressed_mean', 'accordion'\)"),
    ],
)  # fmt: skip
def test_bad_pipeline_keys_are_named(make_config, mesh, keys, error):
    with pytest.raises(ValueError, match=error):
        train.setup(_config(make_config, mesh, **keys))
