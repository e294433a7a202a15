"""BatchNorm in AB mode: synchronised over one group == data parallelism's SyncBatchNorm on the
concatenated batch, per-worker statistics each worker's own, resume bit-identical across a
sync, evaluation with the running statistics, a small digits run that learns."""

import pathlib

import jax
import numpy as np
import pytest

from jaxcomp import models
from jaxcomp import train
from jaxcomp.main import load_config
from jaxcomp.train import _mode
from jaxcomp.train import _trainer

#: AB == data parallelism and evaluation == the model applied by hand to tolerances, a resume
#: bit-identical to a run of the same process and compile setting, a loss/accuracy threshold:
#: no bit of XLA's optimised programs is pinned; compiled unoptimised, the ResNet setups compile
#: faster
pytestmark = pytest.mark.usefixtures("fast_compiles")

REPO = pathlib.Path(__file__).resolve().parents[2]
WORKERS, BATCH = 4, 16
MODEL = dict(width=8, blocks=(1, 1), cuts=(), input_shape=(8, 8, 1), norm="batch")


def _config(make_config, mode="ab", **options):
    c = make_config(
        mode=mode, mesh=[("data", WORKERS)], model_name="resnet18", model=dict(MODEL),
        data=dict(flat=False), optax_name="sgd", lr=0.1, batch_size=BATCH, eval_batch_size=BATCH,
    )  # fmt: skip
    if mode == "ab":  # one group of all the workers; the first steps are full-rank (warm-up)
        c.ab = dict(warmup_steps=100, sync_every=40, full_rank_steps=5, group_size=WORKERS,
                    inner="sgd", **options)  # fmt: skip
    else:
        c.data_parallel = {"transform": "compressed_mean", "codec": {"name": "identity"},
                           **options}  # fmt: skip
    return c


def _two_groups(config):
    """2 groups of 2: warm-up (step 0), exact factorisation, AB steps, a sync every 2 steps.
    The per-worker setups of :func:`runs`, the evaluation and the resume share these options,
    so they share their compiled programs (one compile of the AB step kinds for the three)."""
    options = {k: v for k, v in config.ab.items() if k not in DEFAULT_AB}
    config.ab = dict(warmup_steps=1, sync_every=2, full_rank_steps=1, group_size=2, inner="sgd",
                     **options)  # fmt: skip
    return config


DEFAULT_AB = ("warmup_steps", "sync_every", "full_rank_steps", "group_size", "inner")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _step(s, batch):
    state = s.mode.init(jax.random.key(0))
    key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(1))), s.mesh)
    new, metrics = s.mode.train_step(state, _trainer.place(batch, s.mode.batch_sharding), key, 0)
    return state, new, {k: float(v) for k, v in metrics.items()}


@pytest.fixture(scope="module")
def runs(make_config):
    """One SGD step of AB mode (synchronised and per worker) and of data parallelism (the
    same) on the same batch."""
    setups = {
        "ab_sync": _trainer.setup(_config(make_config, sync_batch_stats=True)),
        "ab_own": _trainer.setup(_two_groups(_config(make_config))),  # step 0: warm-up
        "dp_sync": _trainer.setup(_config(make_config, "data_parallel", sync_batch_stats=True)),
        "dp_own": _trainer.setup(_config(make_config, "data_parallel")),
    }
    batch = next(setups["dp_sync"].train_loader.epoch(0))
    return batch, {name: (s, *_step(s, batch)) for name, s in setups.items()}


def test_one_synchronised_group_is_data_parallel_sync_batchnorm(runs):
    _, r = runs
    _, _, ab, ab_m = r["ab_sync"]
    _, _, dp, dp_m = r["dp_sync"]
    # the statistics of the concatenated batch (DP's test checks them against the
    # single-device model), on every worker of the group
    want = _leaves(dp.model_state)
    assert len(want) == 12  # 6 BatchNorms' running means and variances
    got = _leaves(ab.model_state)
    for a, b in zip(got, want, strict=True):
        assert a.shape == (WORKERS, *b.shape)
        np.testing.assert_allclose(a, np.broadcast_to(b, a.shape), rtol=1e-5, atol=1e-6)
    # the global batch's gradient: AB's first SGD step (momentum trace = g) == DP's SGD step
    for a, b in zip(_leaves(ab.params), _leaves(dp.params), strict=True):
        np.testing.assert_allclose(a[0], b, rtol=1e-4, atol=1e-6)
    assert ab_m["loss"] == pytest.approx(dp_m["loss"], rel=1e-6)
    assert ab_m["accuracy"] == pytest.approx(dp_m["accuracy"], rel=1e-6)


def test_per_worker_statistics_are_each_workers_own_as_in_data_parallelism(runs):
    _, r = runs
    _, _, ab, _ = r["ab_own"]
    _, _, dp, _ = r["dp_own"]  # its per-worker statistics are checked against each shard
    got, want = _leaves(ab.model_state), _leaves(dp.model_state)
    assert len(got) == len(want) == 12
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # both [WORKERS, ...]
    assert not np.allclose(got[0][0], got[0][1])  # the shards differ, so do the statistics


@pytest.mark.parametrize("eval_with", ["worker0", "mean"])
def test_evaluation_uses_the_running_statistics(runs, make_config, eval_with):
    batch, r = runs
    s, _, new, _ = r["ab_own"]
    if eval_with == "mean":
        s = _trainer.setup(_two_groups(_config(make_config, eval_batch_stats="mean")))

    def pick(x):
        return np.asarray(x)[0] if eval_with == "worker0" else np.asarray(x).mean(0)

    params = jax.tree.map(lambda x: np.asarray(x)[0], new.params)
    variables = _mode.join_variables(params, jax.tree.map(pick, new.model_state))
    logits, _ = jax.jit(lambda v, x: s.model.apply(v, x))(variables, batch["x"])
    ev = {**batch, "mask": np.ones(BATCH, np.float32)}
    got = s.mode.eval_step(new, _trainer.place(ev, s.mode.batch_sharding))
    want = _mode.eval_sums(s.model, logits, ev)
    for k in want:
        np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)


def test_resume_across_a_sync_with_batchnorm_is_bit_identical(make_config, check_resume, tmp_path):
    # 2 groups of 2: warm-up, exact factorisation, AB steps, a sync (statistics averaged)
    config = _two_groups(_config(make_config))
    config.total_steps, config.checkpoint_every, config.log_every, config.eval_every = 4, 2, 2, 2
    _, state = check_resume(config, tmp_path)
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    stats = [np.asarray(x) for p, x in paths if "batch_stats" in jax.tree_util.keystr(p)]
    assert len(stats) == 12 and all(x.shape[0] == WORKERS for x in stats)  # saved, per worker
    assert all(np.isfinite(x).all() for x in stats)


def test_ab_with_batchnorm_learns_digits(make_config, tmp_path):
    config = _config(make_config)  # 2 groups of 2, each synchronising its statistics
    config.mesh = [("group", 2), ("member", 2)]
    config.ab = dict(warmup_steps=10, sync_every=10, full_rank_steps=2, inner="adam",
                     sync_batch_stats=True)  # fmt: skip
    config.lr, config.batch_size, config.eval_batch_size = 1e-2, 64, 120
    config.total_steps, config.log_every, config.eval_every, config.checkpoint_every = 60, 10, 60, 0
    train.train_and_evaluate(config, str(tmp_path))
    records = train.read_metrics(str(tmp_path))
    losses = [r["loss"] for r in records if r["split"] == "train"]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert losses[-1] < 0.8 * losses[0], losses
    assert final["accuracy"] > 0.5, (losses, final)  # 10 classes: chance is 0.1


def test_bad_options_and_unsyncable_groups_are_named(make_config):
    with pytest.raises(ValueError, match="sync_batch_stats must be a bool"):
        _trainer.setup(_config(make_config, sync_batch_stats="yes"))
    with pytest.raises(ValueError, match="eval_batch_stats must be one of"):
        _trainer.setup(_config(make_config, eval_batch_stats="worker1"))
    unequal = _config(make_config, sync_batch_stats=True)
    unequal.ab = dict(unequal.ab.to_dict(), group_size=2)  # 5 workers: groups [3, 2]
    unequal.mesh, unequal.batch_size = [("data", 5)], 20
    with pytest.raises(ValueError, match=r"groups \[3, 2\] are not the rows of a"):
        _trainer.setup(unequal)


def test_the_vgg16_ab_config_takes_batchnorm_from_the_command_line():
    config = load_config(f"{REPO}/configs/vgg16_cifar10_ab.py:smoke")
    config = train.apply_overrides(config, {"model.norm": "batch"})
    model = models.get_model(config.model_name, **config.model)
    assert model.has_batch_stats and config.mode == "ab"
