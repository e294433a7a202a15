"""Small configs shared by the trainer tests (dense digits: compiles in a few seconds)."""

import functools

import jax
import ml_collections
import numpy as np
import pytest

from jaxcomp import train


def digits_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "dense"
    c.mesh = [("data", 8)]
    c.model_name = "mlp"
    c.model = dict(hidden=(32, 32, 32))
    c.data_name = "digits"
    c.batch_size = 64
    c.eval_batch_size = 120
    c.total_steps = 12
    c.optax_name = "adam"
    c.lr = 3e-3
    c.log_every = 4
    c.checkpoint_every = 4
    for k, v in overrides.items():
        c[k] = v
    return c


@pytest.fixture(scope="session")  # a pure function: module-scoped fixtures may use it
def make_config():
    return digits_config


def resume_is_bit_identical(
    config: ml_collections.ConfigDict, tmp_path, stop: int = 2, *, last_checkpoint
):
    """Trains ``config`` uninterrupted and stopped after ``stop`` steps then resumed; asserts
    the last checkpointed states are bit-identical and the eval records equal; returns
    ``(step, state)`` of the last checkpoint (a raw pytree as orbax restores it;
    ``last_checkpoint`` is the root conftest's fixture)."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train.train_and_evaluate(config, full)
    assert train.train_and_evaluate(config, part, stop_after=stop) == {"stopped_at": stop}
    train.train_and_evaluate(config, part)
    (s1, a), (s2, b) = last_checkpoint(full), last_checkpoint(part)
    assert s1 == s2 == config.total_steps
    a_leaves, b_leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a_leaves) == len(b_leaves)
    for x, y in zip(a_leaves, b_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    evals = [[r for r in train.read_metrics(w) if r["split"] == "eval"] for w in (full, part)]
    assert evals[0] == evals[1] and evals[0]
    return s1, a


@pytest.fixture(scope="session")
def check_resume(last_checkpoint):
    return functools.partial(resume_is_bit_identical, last_checkpoint=last_checkpoint)
