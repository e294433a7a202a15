"""PowerSGD codec: exactness on rank-r and rank-deficient matrices (== the best rank-r
approximation at any magnitude), equality with a numpy reference, warm start, orthogonalize,
and the platform-dependent form of ``transposed_matmul``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import compressors
from jaxcomp._cpu import _layouts
from jaxcomp.compressors import _low_rank

# tolerances, exact zeros by construction, shapes and bytes: XLA optimisations off (suite speed);
# the non-finite cases run at the default compile in test_nonfinite.py
pytestmark = pytest.mark.usefixtures("fast_compiles")

KEY = jax.random.key(0)


def np_orthogonalize(p, eps=1e-8):
    p = p.copy()
    for i in range(p.shape[1]):
        for j in range(i):
            p[:, i] -= np.dot(p[:, j], p[:, i]) * p[:, j]
        p[:, i] /= np.sqrt(np.dot(p[:, i], p[:, i])) + eps
    return p


@pytest.mark.slow
@pytest.mark.parametrize("shape, rank", [((12, 9), 1), ((12, 9), 3), ((3, 4, 10), 2)])
def test_exact_on_rank_r_matrices(shape, rank):
    rows, cols = _low_rank.matrix_shape(shape)
    rng = np.random.default_rng(0)
    m = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))
    x = jnp.asarray(m.reshape(shape), jnp.float32)
    codec = compressors.power_sgd(rank)

    @jax.jit  # one program per case (eagerly, 35-118 op compiles)
    def round_trip(x):
        payload, _ = codec.compress(x, codec.init(x), None)
        return payload, codec.decompress(payload, x)

    payload, y = round_trip(x)
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)
    assert compressors.wire_bytes(payload) == 4 * (rows + cols) * rank


def test_matches_numpy_reference_over_steps_with_warm_start():
    codec = compressors.power_sgd(2, seed=3)
    xs = jax.random.normal(KEY, (4, 10, 6))
    state = codec.init(xs[0])
    q = np.asarray(jax.random.normal(jax.random.key(3), (6, 2)))
    np.testing.assert_allclose(state.q, q)
    step = jax.jit(lambda x, s: codec.compress(x, s, None))
    for x in xs:
        payload, state = step(x, state)
        m = np.asarray(x, np.float64)
        p = np_orthogonalize(m @ q)
        q = m.T @ p
        np.testing.assert_allclose(payload.p, p, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(payload.q, q, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(state.q, q, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(codec.decompress(payload, x), p @ q.T, rtol=2e-4, atol=2e-4)


def test_warm_start_converges_to_top_singular_subspace():
    u, _ = np.linalg.qr(np.asarray(jax.random.normal(KEY, (30, 20))))
    v, _ = np.linalg.qr(np.asarray(jax.random.normal(jax.random.key(1), (20, 20))))
    x = jnp.asarray((u * (4.0 / (1.0 + np.arange(20)))) @ v.T, jnp.float32)  # clear spectral gap
    codec = compressors.power_sgd(2)
    step = jax.jit(lambda s: codec.compress(x, s, None))
    state = codec.init(x)
    for _ in range(40):
        payload, state = step(state)
    u, s, vt = np.linalg.svd(np.asarray(x))
    best = (u[:, :2] * s[:2]) @ vt[:2]
    np.testing.assert_allclose(codec.decompress(payload, x), best, atol=2e-3)


def _jitted_round_trip(codec):
    """``(x, state, key) -> (payload, new_state, decompress(payload, x))`` jitted (eagerly,
    ~30-50 op compiles per test)."""

    @jax.jit
    def round_trip(x, state, key):
        payload, new_state = codec.compress(x, state, key)
        return payload, new_state, codec.decompress(payload, x)

    return round_trip


def test_one_dimensional_passes_through_and_zeros_stay_zero():
    codec = compressors.power_sgd(2)
    round_trip = _jitted_round_trip(codec)
    v = np.arange(5.0, dtype=np.float32)
    _, state, y = round_trip(v, codec.init(v), None)
    np.testing.assert_array_equal(y, v)
    assert state.q.shape == (0, 0)
    z = np.zeros((6, 4), np.float32)
    state = codec.init(z)
    _, new_state, y = round_trip(z, state, None)
    np.testing.assert_array_equal(y, np.zeros((6, 4)))
    # a dead Q column would freeze the iteration forever; the old one is kept instead
    np.testing.assert_array_equal(new_state.q, state.q)


def test_without_warm_start_q_comes_from_the_key():
    codec = compressors.power_sgd(1, warm_start=False)
    round_trip = _jitted_round_trip(codec)
    assert codec.stochastic
    x = np.random.default_rng(5).standard_normal((5, 4)).astype(np.float32)
    with pytest.raises(ValueError, match="key"):
        round_trip(x, codec.init(x), None)
    p1 = round_trip(x, codec.init(x), jax.random.key(1))[0]
    p2 = round_trip(x, codec.init(x), jax.random.key(1))[0]
    np.testing.assert_array_equal(p1.p, p2.p)


def test_orthogonalize_gives_orthonormal_columns():
    p = np.random.default_rng(6).standard_normal((20, 4)).astype(np.float32)
    p = jax.jit(_low_rank.orthogonalize)(p)
    np.testing.assert_allclose(p.T @ p, np.eye(4), atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Rank-deficient inputs (issue 9 item 1)

RANK = 4


def _low_rank_cases():
    rng = np.random.default_rng(7)

    def product(rows, cols, k):
        return rng.standard_normal((rows, k)) @ rng.standard_normal((k, cols))

    rank2_zero_cols = product(12, 9, 2)
    rank2_zero_cols[:, 3:6] = 0.0
    zero_block = np.zeros((16, 10))
    zero_block[:6, :5] = product(6, 5, 3)
    return {
        "rank1": product(12, 9, 1),
        "rank2_zero_cols": rank2_zero_cols,
        "rank3_zero_block": zero_block,
        "all_zero": np.zeros((12, 9)),
        "rank4_exact": product(12, 9, 4),
        "rank2_conv": product(12, 10, 2).reshape(3, 4, 10),
        "rank1_tall": product(40, 6, 1),
    }


CASES = _low_rank_cases()
MAGNITUDES = (1e-10, 1.0, 1e6)


def best_rank_r(m, r):
    u, s, vt = np.linalg.svd(np.asarray(m, np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vt[:r]


def numerical_rank(m):
    return np.linalg.matrix_rank(np.asarray(m, np.float64), tol=1e-6 * max(np.abs(m).max(), 1e-300))


@pytest.fixture(scope="module")
def steppers():
    """Jitted ``(x, state, key) -> (payload, state, x_hat)`` per warm-start mode (compiled once
    per input shape)."""
    out = {}
    for warm in (True, False):
        codec = compressors.power_sgd(RANK, warm_start=warm)

        def step(x, state, key, codec=codec):
            payload, state = codec.compress(x, state, key)
            return payload, state, codec.decompress(payload, x)

        out[warm] = (codec, jax.jit(step))
    return out


#: the cases of their own shape beyond one matrix (12 x 9: four cases, one compile) and one
#: conv kernel (3 x 4 x 10): a compile each, in the slow tier
OWN_SHAPE_SLOW = ("rank1_tall", "rank3_zero_block")


@pytest.mark.parametrize("magnitude", MAGNITUDES, ids=lambda m: f"{m:g}")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c in OWN_SHAPE_SLOW else c for c in sorted(CASES)],
)
def test_rank_deficient_reconstruction_is_the_best_rank_r_approximation(
    case, warm, magnitude, steppers
):
    codec, step = steppers[warm]
    x = jnp.asarray(CASES[case] * magnitude, jnp.float32)
    rows, cols = _low_rank.matrix_shape(x.shape)
    m = np.asarray(x, np.float64).reshape(rows, cols)
    k = numerical_rank(m)
    assert k <= RANK
    best = best_rank_r(m, RANK)
    atol = 2e-6 * max(np.abs(m).max(), 1e-300)
    state = codec.init(x)
    for i in range(3):  # the warm start carries over steps with dead columns
        payload, state, x_hat = step(x, state, jax.random.key(i))
        np.testing.assert_allclose(np.asarray(x_hat).reshape(rows, cols), best, rtol=0, atol=atol)
        p = np.asarray(payload.p, np.float64)
        alive = np.any(p != 0, axis=0)
        assert alive.sum() == k, alive  # a dependent column of M Q is exactly zero
        np.testing.assert_allclose(p.T @ p, np.diag(alive.astype(float)), atol=1e-6)
        assert np.all(np.isfinite(np.asarray(state.q)))


#: one jitted PowerSGD compress for every test here (a jit per test or case compiled it again)
CODEC = compressors.power_sgd(RANK)
COMPRESS = jax.jit(lambda x, s: CODEC.compress(x, s, None))


def test_dead_columns_keep_the_previous_query_and_a_new_direction_is_found():
    codec, step = CODEC, COMPRESS
    rank1 = jnp.asarray(CASES["rank1"], jnp.float32)
    state0 = codec.init(rank1)
    state = state0
    for _ in range(3):
        payload, state = step(rank1, state)
    # one live column; the three dead ones kept the initial Q's columns exactly
    np.testing.assert_array_equal(np.asarray(state.q)[:, 1:], np.asarray(state0.q)[:, 1:])
    for x in (CASES["rank4_exact"], np.zeros((12, 9)), CASES["rank4_exact"]):
        x = jnp.asarray(x, jnp.float32)
        payload, state = step(x, state)
        np.testing.assert_allclose(
            codec.decompress(payload, x), best_rank_r(x, RANK), atol=2e-6 * float(jnp.abs(x).max())
        )
    assert np.all(np.isfinite(np.asarray(state.q)))


@pytest.mark.parametrize(
    "case",
    [  # eager PowerSGD compiles op by op: one case in the fast tier, the one with dead columns
        pytest.param("rank1", marks=pytest.mark.slow),
        "rank2_zero_cols",
        pytest.param("rank4_exact", marks=pytest.mark.slow),
        pytest.param("all_zero", marks=pytest.mark.slow),
    ],
)
def test_jit_and_eager_agree(case):
    x = jnp.asarray(CASES[case], jnp.float32)
    state = CODEC.init(x)
    eager = CODEC.compress(x, state, None)
    jitted = COMPRESS(x, state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), eager, jitted)
    alive_e = np.any(np.asarray(eager[0].p) != 0, axis=0)
    alive_j = np.any(np.asarray(jitted[0].p) != 0, axis=0)
    np.testing.assert_array_equal(alive_e, alive_j)


@pytest.mark.user_numerics
def test_orthogonalize_zeroes_dependent_columns_at_every_magnitude():
    # jitted, as PowerSGD's compress runs it: one compile for the nine inputs (eagerly, each
    # call dispatched its operations one by one: 2.5 s of CPU)
    orthogonalize = jax.jit(_low_rank.orthogonalize)
    a, b = np.random.default_rng(1).standard_normal((2, 30))
    p = np.stack([a, 2 * a, b, a - 3 * b, np.zeros(30)], axis=1)
    ref = np.asarray(orthogonalize(p.astype(np.float32)))
    alive = np.any(ref != 0, axis=0)
    np.testing.assert_array_equal(alive, [True, False, True, False, False])
    np.testing.assert_allclose(ref.T @ ref, np.diag(alive.astype(float)), atol=1e-6)
    for magnitude in (1e-30, 1e-10, 1e6, 1e30):
        got = orthogonalize((p * magnitude).astype(np.float32))
        np.testing.assert_allclose(got, ref, atol=1e-6)
    for power in (-100, -33, 20, 100):  # a power-of-two scale is exact: bit-identical result
        got = orthogonalize(p.astype(np.float32) * np.float32(2.0**power))
        np.testing.assert_array_equal(got, ref)


def test_orthogonalize_old_call_form_and_tolerance():
    p = jnp.asarray(np.random.default_rng(2).standard_normal((20, 3)), jnp.float32)
    dep = jnp.stack([p[:, 0], p[:, 1], p[:, 0] + 1e-3 * p[:, 2]], axis=1)
    # positional epsilon (the old signature); 1e-8 is now a relative tolerance
    kept = _low_rank.orthogonalize(dep, 1e-8)
    np.testing.assert_allclose(kept.T @ kept, np.eye(3), atol=1e-5)
    # a column whose new part is 1e-3 of its norm is dropped at tolerance 1e-2, kept at 1e-4
    assert np.all(np.asarray(_low_rank.orthogonalize(dep, 1e-2))[:, 2] == 0)
    assert np.any(np.asarray(_low_rank.orthogonalize(dep))[:, 2] != 0)


# ----------------------------------------------------------------------------------------------
# transposed_matmul: the CPU form is chosen at lowering time (issue 14 item 2)


@pytest.mark.parametrize("r", [1, 3])
def test_transposed_matmul_forms_agree(r):
    m = jax.random.normal(KEY, (64, 48))
    p = jax.random.normal(jax.random.key(1), (64, r))
    want = np.asarray(m, np.float64).T @ np.asarray(p, np.float64)
    cpu = jax.jit(_layouts.transposed_matmul)(m, p)
    dot = jax.jit(lambda m, p: m.T @ p)(m, p)
    np.testing.assert_allclose(cpu, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dot, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_low_rank.transposed_matmul(m, p), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "tpu"])
def test_exported_power_sgd_takes_the_platforms_matmul_form(platform):
    codec = compressors.power_sgd(3)
    x = jax.ShapeDtypeStruct((64, 48), jnp.float32)
    state = jax.eval_shape(codec.init, x)
    exported = jax.export.export(
        jax.jit(lambda x, s: codec.compress(x, s, None)), platforms=[platform]
    )(x, state)
    text = exported.mlir_module()
    cpu_form = "tensor<64x48x3xf32>" in text  # the broadcast multiply-and-reduce
    assert cpu_form == (platform == "cpu"), platform
    if platform != "cpu":
        # M @ Q and M^T @ P, both as dots (contracting dims 1 and 0 of M)
        assert text.count("stablehlo.dot_general") >= 2


@pytest.mark.parametrize(
    "kwargs",
    [dict(rank=0), dict(rank=1.5), dict(epsilon=-1.0), dict(epsilon=1.5), dict(epsilon=True)],
)
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError, match="rank|epsilon"):
        compressors.power_sgd(**kwargs)
