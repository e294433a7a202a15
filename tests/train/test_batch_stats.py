"""BatchNorm in the data-parallel mode: per-worker or synchronised statistics, evaluation,
measured sync bytes, resume; the dense mode's BatchNorm against the single-device model."""

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
from jaxcomp import transforms
from jaxcomp.models import _norm as _norms
from jaxcomp.models import _staged
from jaxcomp.train import _mode
from jaxcomp.train import _trainer

#: tolerances against the single-device model, bytes from the lowered step, a resume
#: bit-identical to a run of the same process and compile setting: no bit of XLA's optimised
#: programs is pinned; compiled unoptimised, the ResNet setups compile faster (and the
#: data-parallel ones are those of tests/train/test_ab_batch_norm.py: one cache entry each)
pytestmark = pytest.mark.usefixtures("fast_compiles")

WORKERS, BATCH = 4, 16
MODEL = dict(width=8, blocks=(1, 1), cuts=(), input_shape=(8, 8, 1), norm="batch")


def _config(make_config, mode="data_parallel", **dp):
    c = make_config(
        mode=mode,
        mesh=[("data", WORKERS)],
        model_name="resnet18",
        model=dict(MODEL),
        data=dict(flat=False),
        optax_name="sgd",
        lr=0.1,
        batch_size=BATCH,
        eval_batch_size=BATCH,
    )
    if mode == "data_parallel":
        c.data_parallel = {"transform": "compressed_mean", "codec": {"name": "identity"}, **dp}
    return c


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
    """One SGD step of the dense, synchronised and per-worker modes on the same batch."""
    setups = {
        "dense": _trainer.setup(_config(make_config, "dense")),
        "sync": _trainer.setup(_config(make_config, sync_batch_stats=True)),
        "per_worker": _trainer.setup(_config(make_config)),
    }
    batch = next(setups["dense"].train_loader.epoch(0))
    return batch, {name: (s, *_step(s, batch)) for name, s in setups.items()}


def _single_device(model, variables, x):
    """The unsharded model on ``x``: ``(logits, new variables)``."""
    return jax.jit(lambda v, x: model.apply(v, x, train=True))(variables, jnp.asarray(x))


def test_dense_and_sync_batch_stats_equal_the_statistics_of_the_concatenated_batch(runs):
    batch, r = runs
    s, state, dense, _ = r["dense"]
    variables = _mode.join_variables(*jax.device_get((state.params, state.model_state)))
    _, reference = _single_device(s.model, variables, batch["x"])
    want = _leaves(_mode.split_variables(reference)[1])
    assert len(want) == 12  # stem + layer1 (2) + layer2 (3) BatchNorms, mean and var
    for got in (dense.model_state, r["sync"][2].model_state):
        for a, b in zip(_leaves(got), want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # SyncBatchNorm's gradient is the global batch's: the same SGD step as dense
    for a, b in zip(_leaves(r["sync"][2].params), _leaves(dense.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert r["sync"][3]["loss"] == pytest.approx(r["dense"][3]["loss"], rel=1e-6)


def test_per_worker_statistics_are_each_workers_own(runs):
    batch, r = runs
    s, state, new, _ = r["per_worker"]
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


@pytest.mark.parametrize("eval_with", ["worker0", "mean"])
def test_evaluation_uses_worker0s_or_the_mean_running_statistics(runs, make_config, eval_with):
    batch, r = runs
    _, _, new, _ = r["per_worker"]
    s = _trainer.setup(_config(make_config, eval_batch_stats=eval_with))

    def pick(x):
        return np.asarray(x)[0] if eval_with == "worker0" else np.asarray(x).mean(0)

    stats = tuple(jax.tree.map(pick, part.value) for part in new.model_state)
    variables = _mode.join_variables(jax.device_get(new.params), stats)
    logits, _ = jax.jit(lambda v, x: s.model.apply(v, x))(variables, jnp.asarray(batch["x"]))
    ev = {**batch, "mask": np.ones(BATCH, np.float32)}
    got = s.mode.eval_step(new, _trainer.place(ev, s.mode.batch_sharding))
    want = _mode.eval_sums(s.model, logits, {**ev, "mask": jnp.asarray(ev["mask"])})
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)


def test_sync_batch_stats_bytes_are_measured_and_counted(runs):
    _, r = runs
    sync, per_worker = r["sync"][0].mode, r["per_worker"][0].mode
    assert per_worker.extra["batch_stats_bytes"] == 0
    bn_floats = sum(x.size for x in _leaves(r["sync"][1].model_state))  # mean + var, 144
    # forward: mean and variance; backward: at least their two cotangents (float32)
    assert 4 * 2 * bn_floats <= sync.extra["batch_stats_bytes"] <= 4 * 4 * bn_floats
    extra = r["sync"][3]["wire_bytes"] - r["per_worker"][3]["wire_bytes"]
    assert extra == sync.extra["batch_stats_bytes"]
    assert "SyncBatchNorm" in sync.extra["batch_stats"]


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


@pytest.mark.parametrize("mode", ["data_parallel", "dense"])
def test_resume_with_batchnorm_is_bit_identical(make_config, check_resume, tmp_path, mode):
    # data parallel: error feedback keeps per-worker residuals beside per-worker statistics
    dp = {"codec": {"name": "top_k", "fraction": 0.1, "feedback": "ef"}}
    config = _config(make_config, mode, **(dp if mode == "data_parallel" else {}))
    config.total_steps, config.checkpoint_every, config.log_every, config.eval_every = 4, 2, 2, 2
    _, state = check_resume(config, tmp_path)
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    stats = [np.shape(x) for p, x in paths if "batch_stats" in jax.tree_util.keystr(p)]
    assert len(stats) == 12  # 6 BatchNorms' means and variances, saved
    per_worker = [s[:1] == (WORKERS,) for s in stats]
    assert all(per_worker) if mode == "data_parallel" else not any(per_worker)


class _PlainBN(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.BatchNorm(use_running_average=not train)(x.reshape(x.shape[0], -1))


def test_bad_batch_stats_options_and_models_are_named(make_config):
    with pytest.raises(ValueError, match="sync_batch_stats must be a bool"):
        _trainer.setup(_config(make_config, sync_batch_stats="yes"))
    with pytest.raises(ValueError, match="eval_batch_stats must be one of"):
        _trainer.setup(_config(make_config, eval_batch_stats="worker1"))
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
