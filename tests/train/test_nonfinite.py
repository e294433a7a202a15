"""A non-finite step is skipped, counted and never committed nor saved, in every mode.

Each mode (dense, data parallel, pipeline, AB-Training) on the digits MLP (conftest's
``MODE_OPTIONS``), two runs:

* Adam at its usual learning rate, batches 2 and 3 of the run made non-finite: a NaN pixel
  (the loss and gradients are NaN) and a batch of ``1e20`` (finite loss and gradients whose
  squares overflow Adam's second moment: committed, the weights would never move again). Both
  steps are skipped: the checkpoints after steps 1, 2 and 3 hold the same state, training goes
  on after them, and the summary counts 2 skipped steps.
* The same setups from a state whose Adam first moment is ``1e38`` (finite): finite loss and
  gradients, an update that is not (the bias correction divides the moment by ``1 - 0.9``,
  past float32's largest). Each step says so and changes nothing; after
  ``max_nonfinite_in_a_row`` of them the run stops with the last finite state saved (that
  initial one).

Unoptimised (``fast_compiles``): what is checked here is the wiring (a step's flag decides
what is committed, counted, saved and when the run stops). The flag's numerics (``sum(0 * v)``
over the written state, NaN and Inf at every magnitude, eager, jitted and in each worker) are
pinned on the fusion emitters users get, optimised, by ``tests/test_finite.py``'s
``user_numerics`` tests; the loop-emitter processes compile none of users' programs anyway.
"""

import math
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxcomp import pipeline
from jaxcomp import train
from jaxcomp.train import _trainer

pytestmark = pytest.mark.usefixtures("shared_setups", "fast_compiles", "eval_compiled_when_called")

#: the dense mode in the fast tier, every mode in the full suite
MODES = (
    "dense",
    *(pytest.param(m, marks=pytest.mark.slow) for m in ("data_parallel", "pipeline", "ab")),
)
BAD = {1: np.nan, 2: 1e20}  # loader index (the step before it) -> what the batch becomes


class _Corrupting:
    """A loader whose batches at the indices of :data:`BAD` are made non-finite."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def next(self, state):
        batch, new = self._loader.next(state)
        bad = BAD.get(int(state.index))
        if bad is not None:
            batch = dict(batch, x=batch["x"].copy())
            if np.isnan(bad):
                batch["x"][3, 5] = bad
            else:
                batch["x"][...] = bad
        return batch, new


def _state_at(workdir, step):
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(pathlib.Path(workdir) / "checkpoints" / str(step) / "state")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b):
    la, lb = _leaves(a), _leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(la, lb))


#: the config of every run here: the first test's setups serve the second
RUN = dict(total_steps=5, checkpoint_every=1, keep_checkpoints=5, log_every=1)


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_batches_are_skipped_and_the_run_goes_on(
    mode, make_mode_config, shared_setups, monkeypatch, tmp_path, request
):
    if mode == "dense":  # the curves of a run whose skipped steps record no loss
        request.getfixturevalue("curves")
    config = make_mode_config(mode, **RUN)
    s = shared_setups(config)
    corrupting = s._replace(train_loader=_Corrupting(s.train_loader))
    monkeypatch.setattr(_trainer, "setup", lambda config, devices=None: corrupting)
    summary = train.train_and_evaluate(config, str(tmp_path))
    assert summary["steps"] == 5 and summary["nonfinite_steps"] == 2
    states = {t: _state_at(tmp_path, t)["mode_state"] for t in (1, 2, 3, 4, 5)}
    assert _same(states[1], states[2]) and _same(states[1], states[3])  # nothing committed
    assert not _same(states[3], states[4])  # the next finite batch trains
    assert all(np.isfinite(x).all() for x in _leaves(states[5]) if x.dtype.kind == "f")
    records = [r for r in train.read_metrics(str(tmp_path)) if r["split"] == "train"]
    assert [r["nonfinite_steps"] for r in records] == [0, 1, 2, 2, 2]
    assert "loss" not in records[1] and "loss" not in records[2]
    assert mode != "dense" or (tmp_path / "metrics.png").exists()


def _one_step(s, state, step):
    batch, _ = s.train_loader.next(_trainer.data.LoaderState(0, step))
    key = _trainer._replicated(np.asarray(jax.random.key_data(jax.random.key(step))), s.mesh)
    return s.mode.train_step(state, _trainer.place(batch, s.mode.batch_sharding), key, step)


def _is_first_moment(path):
    return any(getattr(k, "name", None) == "mu" for k in path)  # optax's ScaleByAdamState


def _is_packed(x):
    return isinstance(x, pipeline.PackedParams)


def _overflowing(state):
    """``state`` with every Adam first moment ``1e38``: finite, and ``0.9 * 1e38 + 0.1 g``
    bias-corrected (divided by ``1 - 0.9`` at the first step) overflows float32. The
    pipeline's optimizer state is packed per stage (its layout says where each moment is)."""

    def moment(path, x):
        if isinstance(x, pipeline.PackedParams):
            buffers = {g: np.array(b) for g, b in x.buffers.items()}
            for s, tree in enumerate(x.layout.structs()):
                paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
                for p, slot in zip(paths, x.layout.slots[s], strict=True):
                    if _is_first_moment(p):
                        end = slot.offset + math.prod(slot.shape)
                        buffers[slot.group][s, slot.offset : end] = 1e38
            placed = {g: jax.device_put(b, x.buffers[g].sharding) for g, b in buffers.items()}
            return pipeline.PackedParams(placed, x.layout)
        if _is_first_moment(path):
            return jax.device_put(np.full(x.shape, 1e38, x.dtype), x.sharding)
        return x

    new = jax.tree_util.tree_map_with_path(moment, state, is_leaf=_is_packed)
    assert not _same(new, state)  # every mode's optimizer here is Adam
    return new


@pytest.mark.parametrize("mode", MODES)
def test_an_overflowing_update_is_never_committed_and_stops_the_run(
    mode, make_mode_config, shared_setups, monkeypatch, tmp_path
):
    s = shared_setups(make_mode_config(mode, **RUN))
    init = _overflowing(s.mode.init(jax.random.key(0)))
    before = jax.device_get(init)
    state = init
    for step in range(3):  # AB: the warm-up, then the step with the factorisation
        state, metrics = _one_step(s, state, step)
        assert np.isfinite(float(metrics["loss"])) and int(metrics["finite"]) == 0
        if "grad_norm" in metrics:
            assert np.isfinite(float(metrics["grad_norm"]))
        if mode == "ab":  # a skipped step leaves the schedule: the state's kind, the warm-up
            assert metrics["wire_bytes"] == s.mode.dense_bytes
        assert _same(before, jax.device_get(state))
    # the run from that state, stopping after 3 such steps (the loop reads the setup's config)
    config = make_mode_config(mode, **RUN, max_nonfinite_in_a_row=3)
    mode_ = s.mode._replace(init=lambda key: _overflowing(s.mode.init(key)))
    run = s._replace(config=train.with_defaults(config), mode=mode_)
    monkeypatch.setattr(_trainer, "setup", lambda config, devices=None: run)
    with pytest.raises(train.NonFiniteError, match="3 training steps in a row"):
        train.train_and_evaluate(config, str(tmp_path))
    target = _trainer.RunState(init, _trainer._replicated(np.zeros(2, np.uint32), s.mesh))
    ckpt = train.Checkpointer(str(tmp_path))
    step, saved, _ = ckpt.restore_latest(target)
    ckpt.close()
    assert step == 3
    assert _same(saved.mode_state, before)  # the last finite state: the initial one
