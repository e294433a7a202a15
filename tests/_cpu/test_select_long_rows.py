"""The long-row select (one tensor, ``d > 65536``, a *strided* sample) against numpy.

``test_select`` covers the short rows (per sample) and ``test_sparse`` a 70001-entry tensor,
whose sample stride is 1. Past ``2 * 131072`` entries the bracket is read off every
``stride``-th key, so an input can fool it: large values exactly where the sample looks (the
bracket lands too high), or everywhere except there (too low, the candidates overflow). Either
way the row must fall back to ``lax.top_k`` and keep the same set; Gaussian rows must take the
fast path. One compiled function per (d, k), every kind run through it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp._cpu import _select

D = (1 << 19) + 77  # sample stride 4, not a multiple of 32 (padded words)
STRIDE = D // 131072


def _row(kind: str) -> np.ndarray:
    rng = np.random.default_rng(KINDS.index(kind))
    x = rng.standard_normal(D)
    sampled = np.zeros(D, bool)
    sampled[::STRIDE] = True
    if kind == "edges":  # magnitudes 1e-10..1e6, zeros of both signs, ties, NaN, +-Inf
        x = x * 10.0 ** rng.uniform(-10, 6, D)
        x[rng.integers(0, D, D // 50)] = 0.0
        x[rng.integers(0, D, D // 50)] = -0.0
        x[rng.integers(0, D, D // 20)] = 1.5
        x[rng.integers(0, D, 7)] = np.nan
        x[rng.integers(0, D, 5)] = -np.inf
    elif kind == "spikes_where_sampled":  # the sample sees only the largest values
        x[sampled] *= 1e3
    elif kind == "spikes_where_not_sampled":  # the sample sees none of them
        x[~sampled & (rng.random(D) < 0.05)] *= 1e3
    elif kind == "quarters":  # few distinct values: a long run of ties at T
        x = np.round(x * 4) / 4
    elif kind == "nan_many":  # more NaN (ranked +inf) than K
        x[rng.permutation(D)[: D // 8]] = np.nan
    elif kind == "all_equal":
        x = np.full(D, -2.0)
    elif kind == "one_ulp_apart":  # every key within a few units of the bracket's pivots
        x = 1.0 + rng.integers(0, 64, D) * 2.0**-23
    return x.astype(np.float32)


KINDS = [
    "normal",
    "edges",
    "spikes_where_sampled",
    "spikes_where_not_sampled",
    "quarters",
    "nan_many",
    "all_equal",
    "one_ulp_apart",
]


@functools.cache
def _select_fn(k: int):
    def f(x):
        pad = -(-D // 32) * 32 - D
        kp = jnp.pad(_select.magnitude_keys(x), ((0, 0), (0, pad)), constant_values=-1)
        _, _, ok = _select._bracketed(kp, D, k)
        return _select.top_k_indices(x, k), ok

    return jax.jit(f)


@pytest.mark.slow
@pytest.mark.parametrize("k", [D // 100, D // 10])
def test_long_row_select_is_the_stable_top_k_for_every_kind(k, load_test_module):
    stable_top = load_test_module("_cpu/test_select.py")._stable_top  # numpy reference
    ok_of = {}
    for kind in KINDS:
        x = _row(kind)
        idx, ok = _select_fn(k)(jnp.asarray(x[None]))
        np.testing.assert_array_equal(np.asarray(idx), stable_top(x[None], k), err_msg=kind)
        ok_of[kind] = bool(np.asarray(ok)[0])
    assert ok_of["normal"] and ok_of["edges"], f"Gaussian rows fell back: {ok_of}"
    # the adversarial sample must make the bracket fail (and the fallback answer), not pass
    assert not ok_of["spikes_where_sampled"], ok_of
