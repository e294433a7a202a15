"""Per-sample buffers on several data replicas: each sample is trained on one replica for the
whole run (the loader's fixed shards), so an AQ-SGD cache is found on every revisit; a resume
that would cut the split otherwise is refused. The loader's own property:
tests/data/test_sources_and_loader.py."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import train
from jaxcomp.train import _cold_sends
from jaxcomp.train import _pipeline_config
from jaxcomp.train import _pipeline_mode
from jaxcomp.train import _trainer
from jaxcomp.train import _workdir

AQ_SGD = {"name": "quantize", "bits": 4, "scale": "feature", "feedback": "aq_sgd"}
TOPK = {"name": "top_k", "fraction": 0.25, "per_sample": True}


def _links(**keys):
    cfg = {**_pipeline_config.PIPELINE_DEFAULTS, **keys}
    return _pipeline_config.links_of(cfg, 2, 100)


@pytest.mark.parametrize(
    "keys, replicas, shards",
    [
        ({"forward": AQ_SGD}, 2, 2),
        ({"forward": AQ_SGD}, 1, 1),
        ({"backward": {**TOPK, "feedback": "ef", "per_sample_buffers": True}}, 4, 4),
        ({"forward": {**TOPK, "feedback": "ef"}}, 2, 1),  # one residual per position
        ({"forward": TOPK}, 2, 1),
        ({"forward": TOPK, "forward_high": AQ_SGD}, 2, 2),  # adaptive: its high link's caches
    ],
)
def test_only_per_sample_buffers_on_replicas_fix_the_shards(keys, replicas, shards):
    assert _pipeline_mode._sample_shards(_links(**keys), replicas) == shards


@pytest.mark.parametrize(
    "axes, batch_axes",
    [([("data", 2), ("stage", 4)], "data"), ([("slow", 2), ("fast", 2), ("stage", 2)], None)],
)
def test_row_block_r_of_a_batch_lands_on_replica_r(axes, batch_axes):
    """``place`` (every process places the same global batch) puts rows ``[r B/R, (r+1) B/R)``
    on the devices of replica ``r``: the loader's shard ``r``. With (slow, fast) axes the
    replica is ``slow * fast_size + fast``."""
    mesh = comm.make_mesh(axes)
    data_axes = batch_axes or ("slow", "fast")
    replicas = int(np.prod([mesh.shape[a] for a in np.atleast_1d(data_axes)]))
    ids = np.repeat(np.arange(replicas), 4).astype(np.int32)  # row block r holds the value r
    placed = _trainer.place({"ids": ids}, NamedSharding(mesh, P(data_axes)))["ids"]
    names = list(mesh.axis_names)
    for shard in placed.addressable_shards:
        where = dict(zip(names, np.argwhere(mesh.devices == shard.device)[0]))
        r = where["data"] if batch_axes else where["slow"] * mesh.shape["fast"] + where["fast"]
        np.testing.assert_array_equal(np.asarray(shard.data), r)


@pytest.mark.parametrize(
    "saved, now, refused",
    [
        ({"examples": 1438, "shards": 2}, {"examples": 1438, "shards": 2}, None),
        (None, {"examples": 1438, "shards": 1}, None),  # before the record: global shuffle
        ({"shards": 2}, {"examples": 1438, "shards": 2}, None),
        (None, {"shards": 2}, "cut as {'shards': 1}; this run cuts it as {'shards': 2}"),
        ({"examples": 1438, "shards": 2}, {"examples": 1438, "shards": 4}, "{'shards': 4}"),
        ({"examples": 1438, "shards": 1}, {"examples": 1400, "shards": 1}, "{'examples': 1400}"),
    ],
)
def test_a_resume_on_another_cut_of_the_split_is_refused(saved, now, refused, tmp_path):
    if refused is None:
        _workdir.check_partition(str(tmp_path), 4, saved, now)
        return
    with pytest.raises(train.SetupError) as e:
        _workdir.check_partition(str(tmp_path), 4, saved, now)
    line = str(e.value)
    assert "\n" not in line and refused in line, line
    assert f"checkpoint step 4 in {tmp_path} was trained on the training split" in line
    assert "per-sample buffers (kept per data replica)" in line and "new --workdir" in line


def test_the_cold_send_warning_names_the_cause_once_and_only_for_revisits():
    watch = _cold_sends.ColdSendWatch()
    assert watch.see(np.array([0, 1, 2]), {}, 1) is None  # a warm-up step: no count
    assert watch.see(np.array([3, 5]), {"cold_sends": 2.0}, 2) is None  # first visits
    assert watch.see(np.array([5, 6]), {"cold_sends": 1.0}, 3) is None  # 6 is new
    assert watch.see(np.array([0, 1]), {"cold_sends": 0.0}, 4) is None
    line = watch.see(np.array([2, 3, -1]), {"cold_sends": 2.0}, 5)  # -1: not a sample
    assert "\n" not in line and line.startswith("step 5: 2 per-sample sends met a cold buffer")
    assert "another data replica" in line and "sample ids" in line
    assert watch.see(np.array([2, 3]), {"cold_sends": 2.0}, 6) is None  # once per run


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compiles", "eval_compiled_when_called")
def test_aq_sgd_on_two_replicas_finds_its_cache_on_every_revisit(make_config):
    """One uncompressed epoch fills the caches, then a compressed one: before each compressed
    step, every sample of replica ``r``'s rows that was trained before is in ``r``'s cache (a
    nonzero row), and no cache row is filled on both replicas."""
    config = make_config(
        mode="pipeline", mesh=[("data", 2), ("stage", 2)], model={"hidden": (16,)},
        batch_size=256, eval_batch_size=32, optax_name="sgd", lr=0.1,
        pipeline={"num_microbatches": 2, "forward": AQ_SGD, "warmup_epochs": 1},
    )  # fmt: skip
    s = train.setup(config)
    assert s.mode.sample_shards == 2 and s.train_loader.shards == 2
    steps = s.train_loader.steps_per_epoch  # 1438 // 256 = 5
    state, data_state = s.mode.init(jax.random.key(0)), s.train_loader.initial_state()
    key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(1))), s.mesh)
    trained, revisits, hits = set(), 0, 0
    watch = _cold_sends.ColdSendWatch()

    def filled(r):
        ends = state.link_states.ends(replica=r)[0].forward
        rows = [np.abs(np.asarray(e.estimate, np.float32)).sum(axis=1) for e in ends]
        np.testing.assert_array_equal(*rows)  # sender and receiver mirror each other
        return set(np.flatnonzero(rows[0]).tolist())

    for step in range(2 * steps):
        batch, data_state = s.train_loader.next(data_state)
        halves = batch["ids"].reshape(2, -1).tolist()
        first_visits = sum(i not in trained for i in batch["ids"].tolist())
        if step >= steps:
            for r, ids in enumerate(halves):
                cached = filled(r)
                revisits += sum(i in trained for i in ids)
                hits += sum(i in trained and i in cached for i in ids)
        state, metrics = s.mode.train_step(
            state, _trainer.place(batch, s.mode.batch_sharding), key, step
        )
        assert metrics["finite"] == 1
        # one per-sample sender (boundary 0's); only a sample never trained meets a cold cache
        assert int(metrics.get("cold_sends", first_visits)) == first_visits, step
        assert watch.see(batch["ids"], _trainer._scalars(metrics), step + 1) is None
        trained.update(i for ids in halves for i in ids)
    assert revisits > 0.85 * steps * 256 and hits == revisits  # the global shuffle: ~50%
    caches = [filled(r) for r in range(2)]
    assert caches[0] & caches[1] == set() and caches[0] | caches[1] == trained
    assert all(i % 2 == r for r in range(2) for i in caches[r])
