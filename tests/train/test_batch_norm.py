"""BatchNorm in the trainer, every mode: per-worker or synchronised statistics against the
single-device model, evaluation with the running statistics, the measured sync bytes; AB-Training
synchronised over one group == data parallelism's SyncBatchNorm; the options named when wrong;
small runs that learn digits. A resume with BatchNorm in every mode: test_resume.py.

One SGD step of each mode's setup on the same batch (:func:`runs`): the setups are built once
for the module (a ResNet of one basic block: the stem's BatchNorm and the block's two).
"""

import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import models
from jaxcomp import parallel
from jaxcomp import train
from jaxcomp import transforms
from jaxcomp.main import load_config
from jaxcomp.models import _norm as _norms
from jaxcomp.models import _staged
from jaxcomp.train import _mode
from jaxcomp.train import _trainer

#: tolerances against the single-device model and between modes, bytes from the lowered step,
#: loss/accuracy thresholds: no bit of XLA's optimised programs is pinned; compiled unoptimised,
#: the ResNet setups compile faster
pytestmark = pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKERS, BATCH = 4, 16
MODEL = dict(width=8, blocks=(1,), cuts=(), input_shape=(8, 8, 1), norm="batch")
NUM_STATS = 6  # the stem's and the block's two BatchNorms, mean and var


def _config(make_config, mode, **options):
    c = make_config(
        mode=mode, mesh=[("data", WORKERS)], model_name="resnet18", model=dict(MODEL),
        data=dict(flat=False), optax_name="sgd", lr=0.1, batch_size=BATCH, eval_batch_size=BATCH,
    )  # fmt: skip
    if mode == "ab":  # one group of all the workers; the first steps are full-rank (warm-up)
        c.ab = dict(warmup_steps=100, sync_every=40, full_rank_steps=5, group_size=WORKERS,
                    inner="sgd", **options)  # fmt: skip
    elif mode == "data_parallel":
        c.data_parallel = {"transform": "compressed_mean", "codec": {"name": "identity"},
                           **options}  # fmt: skip
    return c


def _two_groups(config):
    """AB in 2 groups of 2: warm-up (step 0), exact factorisation, AB steps, a sync every 2
    steps (the options of :func:`runs`' per-worker AB setup and of its evaluation)."""
    options = {k: v for k, v in config.ab.items() if k not in DEFAULT_AB}
    config.ab = dict(warmup_steps=1, sync_every=2, full_rank_steps=1, group_size=2, inner="sgd",
                     **options)  # fmt: skip
    return config


DEFAULT_AB = ("warmup_steps", "sync_every", "full_rank_steps", "group_size", "inner")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _step(s, batch):
    state = s.mode.init(jax.random.key(0))
    before = jax.device_get(state)  # the dense step donates its input
    key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(1))), s.mesh)
    new, metrics = s.mode.train_step(state, _trainer.place(batch, s.mode.batch_sharding), key, 0)
    return before, new, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def runs(make_config):
    """``(batch, {name: (setup, state before, state after, metrics)})``: one SGD step of the
    dense mode, data parallelism and AB (synchronised and per worker) on the same batch."""
    setups = {
        "dense": _trainer.setup(_config(make_config, "dense")),
        "dp_sync": _trainer.setup(_config(make_config, "data_parallel", sync_batch_stats=True)),
        "dp_own": _trainer.setup(_config(make_config, "data_parallel")),
        "ab_sync": _trainer.setup(_config(make_config, "ab", sync_batch_stats=True)),
        "ab_own": _trainer.setup(_two_groups(_config(make_config, "ab"))),  # step 0: warm-up
    }
    batch = next(setups["dense"].train_loader.epoch(0))
    return batch, {name: (s, *_step(s, batch)) for name, s in setups.items()}


def _single_device_sums(model, variables, batch):
    """The evaluation sums of the unsharded model on ``batch`` (one program: eagerly, each
    op of the sums compiled a program of its own)."""

    def sums(variables, batch):
        logits, _ = model.apply(variables, batch["x"])
        return _mode.eval_sums(model, logits, batch)

    return jax.jit(sums)(variables, batch)


def _single_device(model, variables, x):
    """The unsharded model on ``x``: ``(logits, new variables)``."""
    return jax.jit(lambda v, x: model.apply(v, x, train=True))(variables, jnp.asarray(x))


@pytest.mark.slow
def test_dense_and_sync_batch_stats_equal_the_statistics_of_the_concatenated_batch(runs):
    batch, r = runs
    s, state, dense, _ = r["dense"]
    variables = _mode.join_variables(*jax.device_get((state.params, state.model_state)))
    _, reference = _single_device(s.model, variables, batch["x"])
    want = _leaves(_mode.split_variables(reference)[1])
    assert len(want) == NUM_STATS
    for got in (dense.model_state, r["dp_sync"][2].model_state):
        for a, b in zip(_leaves(got), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # SyncBatchNorm's gradient is the global batch's: the same SGD step as dense
    for a, b in zip(_leaves(r["dp_sync"][2].params), _leaves(dense.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert r["dp_sync"][3]["loss"] == pytest.approx(r["dense"][3]["loss"], rel=1e-6)


@pytest.mark.slow
def test_per_worker_statistics_are_each_workers_own(runs):
    batch, r = runs
    s, state, new, _ = r["dp_own"]
    params = jax.device_get(state.params)
    start = [jax.tree.map(lambda x: np.asarray(x)[0], part.value) for part in state.model_state]
    stats = new.model_state[0].value["batch_stats"]
    assert jax.tree.leaves(stats)[0].sharding.spec == P("data")
    n = BATCH // WORKERS
    for w in range(WORKERS):
        _, own = _single_device(
            s.model, _mode.join_variables(params, tuple(start)), batch["x"][w * n : (w + 1) * n]
        )
        got = [x[w] for x in _leaves(stats)]
        for a, b in zip(got, _leaves(own[0]["batch_stats"]), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the workers' statistics differ (their shards do)
    means = np.asarray(stats["stem"]["BatchNorm_0"]["mean"])
    assert not np.allclose(means[0], means[1])


@pytest.mark.slow
@pytest.mark.parametrize("eval_with", ["worker0", "mean"])
def test_data_parallel_evaluates_with_worker0s_or_the_mean_statistics(runs, make_config, eval_with):
    batch, r = runs
    s, _, new, _ = r["dp_own"]  # evaluates with worker 0's statistics (the default)
    if eval_with == "mean":
        s = _trainer.setup(_config(make_config, "data_parallel", eval_batch_stats="mean"))

    def pick(x):
        return np.asarray(x)[0] if eval_with == "worker0" else np.asarray(x).mean(0)

    stats = tuple(jax.tree.map(pick, part.value) for part in new.model_state)
    variables = _mode.join_variables(jax.device_get(new.params), stats)
    ev = {**batch, "mask": np.ones(BATCH, np.float32)}
    got = s.mode.eval_step(new, _trainer.place(ev, s.mode.batch_sharding))
    want = _single_device_sums(s.model, variables, ev)
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)


@pytest.mark.slow
def test_sync_batch_stats_bytes_are_measured_and_counted(runs):
    _, r = runs
    sync, per_worker = r["dp_sync"][0].mode, r["dp_own"][0].mode
    assert per_worker.extra["batch_stats_bytes"] == 0
    bn_floats = sum(x.size for x in _leaves(r["dp_sync"][1].model_state))  # means and vars
    # forward: mean and variance; backward: at least their two cotangents (float32)
    assert 4 * 2 * bn_floats <= sync.extra["batch_stats_bytes"] <= 4 * 4 * bn_floats
    extra = r["dp_sync"][3]["wire_bytes"] - r["dp_own"][3]["wire_bytes"]
    assert extra == sync.extra["batch_stats_bytes"]
    assert "SyncBatchNorm" in sync.extra["batch_stats"]


@pytest.mark.slow
def test_one_synchronised_ab_group_is_data_parallel_sync_batchnorm(runs):
    _, r = runs
    _, _, ab, ab_m = r["ab_sync"]
    _, _, dp, dp_m = r["dp_sync"]
    # the statistics of the concatenated batch (checked against the single-device model
    # above), on every worker of the group
    want = _leaves(dp.model_state)
    assert len(want) == NUM_STATS
    got = _leaves(ab.model_state)
    for a, b in zip(got, want, strict=True):
        assert a.shape == (WORKERS, *b.shape)
        np.testing.assert_allclose(a, np.broadcast_to(b, a.shape), rtol=1e-5, atol=1e-6)
    # the global batch's gradient: AB's first SGD step (momentum trace = g) == DP's SGD step
    for a, b in zip(_leaves(ab.params), _leaves(dp.params), strict=True):
        np.testing.assert_allclose(a[0], b, rtol=1e-4, atol=1e-6)
    assert ab_m["loss"] == pytest.approx(dp_m["loss"], rel=1e-6)
    assert ab_m["accuracy"] == pytest.approx(dp_m["accuracy"], rel=1e-6)


@pytest.mark.slow
def test_ab_per_worker_statistics_are_each_workers_own_as_in_data_parallelism(runs):
    _, r = runs
    _, _, ab, _ = r["ab_own"]
    _, _, dp, _ = r["dp_own"]  # its per-worker statistics are checked against each shard
    got, want = _leaves(ab.model_state), _leaves(dp.model_state)
    assert len(got) == len(want) == NUM_STATS
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # both [WORKERS, ...]
    assert not np.allclose(got[0][0], got[0][1])  # the shards differ, so do the statistics


@pytest.mark.slow
@pytest.mark.parametrize("eval_with", ["worker0", "mean"])
def test_ab_evaluates_with_the_running_statistics(runs, make_config, eval_with):
    batch, r = runs
    s, _, new, _ = r["ab_own"]
    if eval_with == "mean":
        s = _trainer.setup(_two_groups(_config(make_config, "ab", eval_batch_stats="mean")))

    def pick(x):
        return np.asarray(x)[0] if eval_with == "worker0" else np.asarray(x).mean(0)

    params = jax.tree.map(lambda x: np.asarray(x)[0], new.params)
    variables = _mode.join_variables(params, jax.tree.map(pick, new.model_state))
    ev = {**batch, "mask": np.ones(BATCH, np.float32)}
    got = s.mode.eval_step(new, _trainer.place(ev, s.mode.batch_sharding))
    want = _single_device_sums(s.model, variables, ev)
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)


def _norm_stats(x, mesh=None):
    """Running (mean, var) of a BatchNorm started from zeros after one training step on ``x``:
    a tenth of the batch's mean and (biased) variance."""
    bn = _norms.layer("batch", True, None if mesh is None else "data")
    variables = _norms.layer("batch", False).init(jax.random.key(0), x[:2])
    variables = {**variables, "batch_stats": jax.tree.map(jnp.zeros_like, variables["batch_stats"])}

    def run(x):
        _, new = bn.apply(variables, x, mutable=["batch_stats"])
        return new["batch_stats"]["mean"], new["batch_stats"]["var"]

    if mesh is not None:
        run = jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P())
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    return [np.asarray(v, np.float64) for v in jax.jit(run)(x)]


def test_batchnorm_variance_is_exact_at_large_offsets_and_synchronised_across_workers():
    rng = np.random.default_rng(0)
    # one channel per magnitude; every worker's shard has its own offset, so a mean of the
    # workers' variances would miss the spread between them
    spread = np.array([1e-10, 1.0, 1e3, 1e6], np.float32)
    offset = np.array([0.0, 1e4, 1e6, 1e6], np.float32)
    shift = np.repeat(np.arange(WORKERS, dtype=np.float32), 8)[:, None, None, None]
    x = offset + spread * (rng.standard_normal((32, 2, 2, 4)).astype(np.float32) + shift)
    x64 = x.astype(np.float64).reshape(-1, 4)
    want_mean, want_var = 0.1 * x64.mean(0), 0.1 * x64.var(0)
    mesh = comm.make_mesh([("data", WORKERS)], jax.devices()[:WORKERS])
    for mean, var in (_norm_stats(x), _norm_stats(x, mesh)):
        np.testing.assert_allclose(mean, want_mean, rtol=1e-5)
        np.testing.assert_allclose(var, want_var, rtol=1e-4)


class _PlainBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.BatchNorm(use_running_average=not train)(x.reshape(x.shape[0], -1))


def _pipeline_config(make_config, **pipe):
    return make_config(
        mode="pipeline",
        mesh=[("data", 2), ("stage", 2)],
        model_name="resnet18",
        model=dict(width=4, blocks=(1,), input_shape=(8, 8, 1), cuts=("stem",), norm="batch"),
        data=dict(flat=False),
        optax_name="sgd",
        lr=0.05,
        batch_size=16,
        eval_batch_size=16,
        total_steps=4,
        checkpoint_every=2,
        log_every=2,
        eval_every=2,
        pipeline={"num_microbatches": 2, **pipe},
    )


def test_bad_batch_stats_options_and_models_are_named(make_config):
    for mode in ("data_parallel", "ab"):
        with pytest.raises(ValueError, match="sync_batch_stats must be a bool"):
            _trainer.setup(_config(make_config, mode, sync_batch_stats="yes"))
        with pytest.raises(ValueError, match="eval_batch_stats must be one of"):
            _trainer.setup(_config(make_config, mode, eval_batch_stats="worker1"))
    with pytest.raises(ValueError, match="pipeline.sync_batch_stats must be a bool"):
        _trainer.setup(_pipeline_config(make_config, sync_batch_stats="yes"))
    with pytest.raises(ValueError, match="pipeline.eval_batch_stats must be one of"):
        _trainer.setup(_pipeline_config(make_config, eval_batch_stats="worker1"))
    unequal = _config(make_config, "ab", sync_batch_stats=True)
    unequal.ab = dict(unequal.ab.to_dict(), group_size=2)  # 5 workers: groups [3, 2]
    unequal.mesh, unequal.batch_size, unequal.eval_batch_size = [("data", 5)], 20, 20
    with pytest.raises(ValueError, match=r"groups \[3, 2\] are not the rows of a"):
        _trainer.setup(unequal)
    model = _staged.make_staged(
        "plain", [("bn", _PlainBN())], (), (), input_shape=(4,), input_dtype=jnp.float32,
        num_outputs=4, task="classification",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"segments \['bn'\] keep BatchNorm statistics"):
        model.with_batch_axis("data")
    assert models.resnet18(**MODEL).with_batch_axis("data").segments[1][1].batch_axis == "data"


def test_data_parallel_refuses_a_replicated_model_state_that_differs_per_worker():
    mesh = comm.make_mesh([("data", WORKERS)], jax.devices()[:WORKERS])
    tx = optax.chain(transforms.compressed_mean(compressors.identity()), optax.sgd(0.1))

    def loss_fn(params, model_state, batch):
        local = {"seen": model_state["seen"] + batch["x"].mean()}  # varying, not synchronised
        return ((params["w"] * batch["x"]) ** 2).mean(), local

    dp = parallel.data_parallel(loss_fn, tx, mesh, has_state=True)
    state = dp.init({"w": jnp.ones(3)}, {"seen": jnp.zeros(())})
    with pytest.raises(ValueError, match=r"differ per worker but are not declared PerWorker"):
        dp.step(state, {"x": jnp.ones((8, 3))})
    per_worker = {"seen": compressors.PerWorker(jnp.zeros((1,)))}

    def loss_pw(params, model_state, batch):
        seen = model_state["seen"].value + batch["x"].mean()
        return ((params["w"] * batch["x"]) ** 2).mean(), {"seen": compressors.PerWorker(seen)}

    dp = parallel.data_parallel(loss_pw, tx, mesh, has_state=True)
    x = jnp.arange(24.0).reshape(8, 3)
    state, _ = dp.step(dp.init({"w": jnp.ones(3)}, per_worker), {"x": x})
    np.testing.assert_allclose(
        np.asarray(state.model_state["seen"].value), np.asarray(x).reshape(4, 6).mean(1)
    )
    with pytest.raises(ValueError, match="without has_state"):
        parallel.data_parallel(lambda p, b: 0.0, tx, mesh).init({"w": jnp.ones(3)}, {"s": 1.0})


@pytest.mark.slow  # 40 steps
def test_ab_with_batchnorm_learns_digits(make_config, tmp_path):
    config = _config(make_config, "ab")  # 2 groups of 2, each synchronising its statistics
    config.mesh = [("group", 2), ("member", 2)]
    config.ab = dict(warmup_steps=10, sync_every=10, full_rank_steps=2, inner="adam",
                     sync_batch_stats=True)  # fmt: skip
    config.lr, config.batch_size, config.eval_batch_size = 5e-2, 64, 120
    config.total_steps, config.log_every, config.eval_every, config.checkpoint_every = 40, 10, 40, 0
    train.train_and_evaluate(config, str(tmp_path))
    records = train.read_metrics(str(tmp_path))
    losses = [r["loss"] for r in records if r["split"] == "train"]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert losses[-1] < 0.8 * losses[0], losses
    # 10 classes: chance is 0.1; the eval accuracy was 0.64 after 40 steps (one block)
    assert final["accuracy"] > 0.5, (losses, final)


@pytest.mark.slow  # 40 steps
@pytest.mark.usefixtures("curves")  # the plot of a run evaluated with compression on and off
def test_a_batchnorm_resnet_learns_digits_through_a_compressed_pipeline(make_config, tmp_path):
    config = _pipeline_config(
        make_config, forward={"name": "top_k", "fraction": 0.5, "feedback": "ef"}
    )
    config.model["width"] = 8
    config.optax_name, config.lr, config.batch_size = "adam", 3e-2, 32
    config.total_steps, config.checkpoint_every = 40, 40
    config.log_every, config.eval_every = 10, 40
    config.eval_batch_size = 120
    train.train_and_evaluate(config, str(tmp_path))
    records = train.read_metrics(str(tmp_path))
    losses = [r["loss"] for r in records if r["split"] == "train"]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert losses[-1] < 0.8 * losses[0], losses
    # measured: eval accuracy 0.61 after 40 steps (10 classes: chance is 0.1)
    assert final["accuracy_uncompressed"] > 0.5, (losses, final)
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_the_vgg16_ab_config_takes_batchnorm_from_the_command_line():
    config = load_config(f"{REPO}/configs/vgg16_cifar10_ab.py:smoke")
    config = train.apply_overrides(config, {"model.norm": "batch"})
    model = models.get_model(config.model_name, **config.model)
    assert model.has_batch_stats and config.mode == "ab"
