"""Small configs shared by the trainer tests (dense digits: compiles in a few seconds)."""

import ml_collections
import pytest


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
