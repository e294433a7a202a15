"""Inputs shared by the error-feedback bit-for-bit tests (a fixture: with importlib mode test
modules cannot import each other, nor this file)."""

import types

import numpy as np
import pytest


def edge_inputs(rng, shape, edges, num_workers=2):
    """``(x, memory, positions)`` for a reduction over ``num_workers`` workers.

    ``x`` is standard normal and the memory ``0.5 *`` standard normal, both
    ``[num_workers, *shape]`` float32. On each worker, ``edges`` are written into ``x`` at
    random positions, then ``n // 8`` more positions of ``x`` are set to ``-0.0``, half of them
    with the memory ``-0.0`` too (``-0.0 + -0.0`` stays ``-0.0``). ``positions[w]`` is worker
    ``w``'s random permutation of the ``n`` flat positions (the edges first, then the zeros),
    for the caller's own edge cases after them. Draws from ``rng`` in a fixed order: the same
    ``rng`` state gives the same inputs.
    """
    x = rng.standard_normal((num_workers, *shape)).astype(np.float32)
    memory = (0.5 * rng.standard_normal((num_workers, *shape))).astype(np.float32)
    flat_x, flat_m = x.reshape(num_workers, -1), memory.reshape(num_workers, -1)
    n = flat_x.shape[1]
    positions = []
    for w in range(num_workers):
        pos = rng.permutation(n)
        flat_x[w, pos[: len(edges)]] = edges
        zeros = pos[len(edges) : len(edges) + n // 8]
        flat_x[w, zeros] = -0.0
        flat_m[w, zeros[: len(zeros) // 2]] = -0.0
        positions.append(pos)
    return x, memory, positions


@pytest.fixture(scope="session")
def signals():
    """Helpers for test modules: ``signals.edge_inputs`` (see :func:`edge_inputs`)."""
    return types.SimpleNamespace(edge_inputs=edge_inputs)
