"""GroupNorm and LayerNorm: the two-pass variance, exact at large offsets (float64 reference)."""

import jax
import numpy as np
import pytest

from jaxcomp.models import _norm

# one sample per magnitude (GroupNorm and LayerNorm normalise each sample on its own): offsets
# 0, 1e4, 1e6, 1e6 with spreads 1, 1, 1e3, 1e2. Flax's fast E[x^2] - E[x]^2 is off by 3.9e3,
# 0.89 and 2.8e5 (in units of the spread) on the last three; the two-pass variance by < 3e-3.
OFFSET = np.array([0.0, 1e4, 1e6, 1e6], np.float32)[:, None, None, None]
SPREAD = np.array([1.0, 1.0, 1e3, 1e2], np.float32)[:, None, None, None]


def _reference(x, kind):
    """(x - mean) / sqrt(var + 1e-6) in float64: per pixel (layer) or per group of 8 channels."""
    x64 = x.astype(np.float64)
    n, h, w, c = x.shape
    if kind == "layer":
        g, axes = x64, -1
    else:
        g, axes = x64.reshape(n, h, w, c // 8, 8), (1, 2, 4)
    mean = g.mean(axes, keepdims=True)
    var = ((g - mean) ** 2).mean(axes, keepdims=True)
    return ((g - mean) / np.sqrt(var + 1e-6)).reshape(x.shape)


@pytest.mark.parametrize("kind", ["group", "layer"])
def test_group_and_layer_norm_are_exact_at_offsets_1e4_and_1e6(kind):
    rng = np.random.default_rng(0)
    x = OFFSET + SPREAD * rng.standard_normal((4, 4, 4, 16)).astype(np.float32)
    module = _norm.layer(kind, train=True)
    variables = module.init(jax.random.key(0), x)
    got = np.asarray(jax.jit(module.apply)(variables, x), np.float64)
    err = np.abs(got - _reference(x, kind)).reshape(4, -1).max(axis=1)
    # what is left is float32 rounding of the mean (x's own ulp is 1e-3 at 1e4, 0.06 at 1e6)
    np.testing.assert_array_less(err, [1e-5, 1e-2, 1e-3, 1e-2])


def test_the_models_layer_and_group_norms_are_the_two_pass_ones():
    # gpt and small_cnn build their LayerNorms with _norm.layer_norm
    assert _norm.layer_norm().use_fast_variance is False
    assert _norm.group_norm().use_fast_variance is False
