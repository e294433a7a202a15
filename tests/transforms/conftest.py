"""Fixtures of the transforms' (slow, fast) axis-pair tests."""

import numpy as np
import pytest

from jaxcomp import comm

SLOW, FAST = "slow", "fast"


@pytest.fixture(scope="module")
def pair_mesh():
    """A 2 x 4 ``(slow, fast)`` mesh: 2 hosts of 4 devices."""
    return comm.make_mesh([(SLOW, 2), (FAST, 4)])


@pytest.fixture(scope="session")
def pair_grads():
    """``pair_grads(shape)``: each of the 8 workers' gradient of a dense layer, ``{"w": [8,
    *shape], "b": [8, shape[1]]}`` float32 standard normal (seed 0, drawn ``w`` first)."""

    def make(shape):
        rng = np.random.default_rng(0)
        return {
            "w": rng.standard_normal((8, *shape)).astype(np.float32),
            "b": rng.standard_normal((8, shape[1])).astype(np.float32),
        }

    return make
