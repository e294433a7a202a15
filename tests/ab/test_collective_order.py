"""Where the harness's AB program averages the loss: after the step's update, beside the other
collectives (it ran right after the forward pass, and every device thread waited there), with
the same values."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _programs

# phases: steps 0-1 warm-up, 2 factorise + AB, 3 AB + sync, 4 full rank + re-factorisation,
# 5-6 AB, 7 AB + sync, 8 full rank + re-factorisation, 9 AB
CONFIG = dict(warmup_steps=2, sync_every=4, full_rank_steps=1, exclude=("head",))


def init_params():
    rng = np.random.default_rng(0)
    return {
        "l1": {"kernel": jnp.asarray(rng.standard_normal((8, 6)), jnp.float32),
               "bias": jnp.zeros(6)},
        "head": {"kernel": jnp.full((6, 2), 0.3), "bias": jnp.zeros(2)},
    }  # fmt: skip


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    loss = jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)
    # an int metric, and a constant one (not varying over the workers: no all-reduce)
    rows = jnp.sum(jnp.isfinite(y[:, 0]).astype(jnp.int32))
    return loss, {"twice": 2 * loss, "rows": rows, "const": jnp.asarray(x.shape[0], jnp.int32)}


def batches(steps, bad_step=None):
    rng = np.random.default_rng(2)
    out = [(rng.standard_normal((8, 8), np.float32), rng.standard_normal((8, 2), np.float32))
           for _ in range(steps)]  # fmt: skip
    if bad_step is not None:
        out[bad_step][0][0, 0] = np.nan  # one row of the first worker's shard
    return out


def _entry_schedule(hlo: str) -> list[str]:
    """The entry computation's all-reduces and conditionals, in their scheduled order."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    ops = re.compile(r"\s*(?:ROOT )?%[\w.\-]+ = .*? (?:all-reduce|conditional)\(")
    return [line.strip() for line in entry.splitlines() if ops.match(line)]


def _loss_positions(order: list[str]) -> tuple[list[int], list[int]]:
    """Where the float scalar all-reduces over all 4 workers (the loss and aux means) are,
    and where the conditionals and the gradients' all-reduces are."""
    scalar = re.compile(r"[^=]*= \(?\w+\[\](, \w+\[\])*\)? all-reduce")
    means = [i for i, op in enumerate(order)
             if " all-reduce(" in op and "replica_groups={{0,1,2,3}}" in op and scalar.match(op)
             and "f32[]" in op.split(" all-reduce(")[0]]  # fmt: skip
    # the finiteness check's cond (an int32 flag, no collective) reads the loss: it comes last
    check = [i for i, op in enumerate(order) if re.search(r"= \(s32\[\]\S*\) conditional\(", op)]
    assert len(check) <= 1 and all(i == len(order) - 1 for i in check), order
    others = [i for i, op in enumerate(order)
              if i not in check and (" conditional(" in op or not scalar.match(op))]  # fmt: skip
    return means, others


@pytest.fixture(scope="module")
def mesh():
    return parallel.ab_mesh(2, jax.devices()[:4])


def _harness(with_programs, config, mesh):
    """``ab_data_parallel`` of ``config`` and the ``Programs`` it runs (to trace its AB program
    again with another ``_after_update``: the only program that calls it)."""
    return with_programs(
        lambda: parallel.ab_data_parallel(loss_fn, config, mesh, has_aux=True, donate=False)
    )


@pytest.fixture(scope="module")
def harness(mesh, with_programs):
    """The default options' harness, shared: its programs compile once for the tests here."""
    return _harness(with_programs, transforms.ABConfig(1e-2, **CONFIG), mesh)


def _ab_hlo(dp, programs, name):
    state, batch = dp.init(init_params()), dp.shard_batch(batches(1)[0])
    args = programs._args(name, state, batch)[: 3 if name == "ab" else 2]
    return _entry_schedule(programs.compiled(name, *args).as_text())


def _early(monkeypatch, programs):
    """From here ``programs`` runs an AB program traced without the data dependency (the
    dense and transition programs do not call ``_after_update``: kept, not compiled again);
    returns a function that puts the original AB program back."""
    monkeypatch.setattr(_programs, "_after_update", lambda metrics, params: metrics)
    late = programs._programs.pop("ab")
    return lambda: programs._programs.__setitem__("ab", late)


@pytest.mark.slow
def test_the_loss_mean_is_the_ab_programs_last_collective(harness, monkeypatch):
    dp, programs = harness
    order = _ab_hlo(dp, programs, "ab")
    # the role cond (the factor's group mean), the head's group mean, the sync cond, and
    # last the loss and aux means over all workers (XLA may combine them)
    means, others = _loss_positions(order)
    assert means and len(others) == 3 and min(means) > max(others), order
    # the dense program keeps the loss in its gradients' all-reduce
    dense = _ab_hlo(dp, programs, "dense")
    means, others = _loss_positions(dense)
    assert not means and len(others) == 1, dense
    assert "f32[]" in dense[others[0]].split(" all-reduce(")[0], dense
    # where XLA put it without the data dependency: not last (this test can fail)
    restore = _early(monkeypatch, programs)
    try:
        early = _ab_hlo(dp, programs, "ab")
    finally:
        restore()
    means, others = _loss_positions(early)
    assert means and len(others) == 3 and min(means) < max(others), early


def _run(dp, data):
    state, out = dp.init(init_params()), []
    for batch in data:
        state, metrics = dp.step(state, batch)
        out.append([np.asarray(x) for x in jax.tree.leaves((state, metrics))])
    return out


#: the bit-identity runs: the AB phase from the first step (factorisation + AB, AB, AB, AB +
#  sync), so that each run compiles the transition and the AB programs only (a warm-up's dense
#  program, 0.5-0.8 s optimised, runs no ``_after_update``)
AB_FIRST = dict(CONFIG, warmup_steps=0)


@pytest.mark.user_numerics
@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"reset_opt": True, "sync_mode": "only-learned"}])
def test_every_state_and_metric_leaf_is_bit_identical_to_the_loss_mean_after_the_forward(
    mesh, with_programs, monkeypatch, options
):
    config = transforms.ABConfig(1e-2, **AB_FIRST, **options)
    assert [config.schedule.step_kind(t) for t in range(4)] == ["ab"] * 3 + ["ab_then_sync"]
    dp, programs = _harness(with_programs, config, mesh)
    data = batches(4)
    late = _run(dp, data)
    before = dict(programs._programs)
    assert set(before) == {"ab", "refactor"}, before
    restore = _early(monkeypatch, programs)
    try:
        early = _run(dp, data)
        # the same transition program; the AB program traced again (this test compares two
        # different AB programs)
        assert programs._programs["refactor"] is before["refactor"]
        assert programs._programs["ab"] is not before["ab"]
    finally:
        restore()
    for step, (got, want) in enumerate(zip(late, early, strict=True)):
        for x, y in zip(got, want, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert x.tobytes() == y.tobytes(), f"step {step} differs"  # -0, NaN bits too


def test_a_nan_on_one_worker_still_makes_the_ab_steps_loss_and_finite_flag_say_so(harness):
    dp, _ = harness
    state = dp.init(init_params())
    data = batches(4, bad_step=3)
    for batch in data[:3]:
        state, metrics = dp.step(state, batch)
    assert np.isfinite(metrics["loss"]) and np.min(metrics["finite"]) == 1
    _, metrics = dp.step(state, data[3])  # an AB step with its sync
    assert np.isnan(metrics["loss"]) and np.isnan(metrics["aux"]["twice"])
    assert np.min(metrics["finite"]) == 0
    assert metrics["aux"]["rows"] == 2 and metrics["aux"]["const"] == 2  # rows per worker
