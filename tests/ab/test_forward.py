"""AB-Training's factorised forward: ``(x A) B`` in the grouped step's AB programs gives the dense
path's numbers up to float summation order, with fewer operations; the Flax hook computes only
the layers it should."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomp import models
from jaxcomp import parallel
from jaxcomp import transforms
from jaxcomp.ab import _programs
from jaxcomp.ab._forward import Factors
from jaxcomp.ab._forward import cheaper

#: tolerances between two programs compiled alike and a flop count: unoptimised compiles
pytestmark = pytest.mark.usefixtures("fast_compiles")


class Net(nn.Module):
    """8 -> 6 (a tall kernel) -> 10 (a wide one: its tall view is transposed) -> 2 (excluded)."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(6, name="tall")(x))
        x = jnp.tanh(nn.Dense(10, name="wide")(x))
        return nn.Dense(2, name="head")(x)


NET = Net()


def fit_loss(params, batch):
    x, y = batch
    return jnp.mean((NET.apply({"params": params}, x) - y) ** 2)


def loss_fn(params, batch):
    # a reader of a factorised weight that is not a Dense layer: its gradient must still
    # reach the factors (through W = A B)
    return fit_loss(params, batch) + 1e-2 * jnp.sum(params["tall"]["kernel"] ** 2)


def _batch(seed):
    rng = np.random.default_rng(seed)  # 8 rows: 2 per worker, where (x A) B is cheaper
    return rng.standard_normal((8, 8), np.float32), rng.standard_normal((8, 2), np.float32)


@pytest.fixture(scope="module")
def runs():
    """The state after the first factorisation and two AB steps (the second with the sync),
    through the dense weights and through the factors; the flops of both AB programs for the
    model's loss alone (the regulariser reads W = A B: through the factors it costs both
    products G Bᵀ and Aᵀ G, where the dense path forms only its role's)."""
    mesh = parallel.ab_mesh(2, jax.devices()[:4])
    # a linear inner optimizer (momentum): the two paths differ by the gradients' rounding only
    config = transforms.ABConfig(0.1, warmup_steps=1, sync_every=4, full_rank_steps=1,
                                 exclude=("head",), inner=optax.trace(0.9))  # fmt: skip
    dp = parallel.ab_data_parallel(loss_fn, config, mesh, donate=False)
    params = NET.init(jax.random.key(0), jnp.zeros((1, 8)))["params"]  # here, not at collection
    state = dp.init(params)
    state = dp.step(state, _batch(0))[0]  # the warm-up step
    out = {}
    for name, hook in (("dense", None), ("factored", models.factored_dense)):
        programs = _programs.Programs(config, loss_fn, mesh, donate=False, factored_forward=hook)
        s, losses = programs.run("factorise", state)[0], []
        for kind, seed in (("ab", 1), ("ab_then_sync", 2)):
            s, metrics = programs.run(kind, s, dp.shard_batch(_batch(seed)))
            losses.append(float(metrics["loss"]))
        out[name] = (s, losses)
    flops = {}
    for name, hook in (("dense", None), ("factored", models.factored_dense)):
        programs = _programs.Programs(config, fit_loss, mesh, donate=False, factored_forward=hook)
        args = programs._args("ab", out["factored"][0], dp.shard_batch(_batch(1)))
        # the lowered program's count: the same dots as the compiled one's (unoptimised here),
        # without compiling two programs that never run
        flops[name] = programs._program("ab").lower(*args).cost_analysis()["flops"]
    out["flops"], out["params"] = flops, params
    return out


def test_factored_steps_give_the_dense_paths_numbers_up_to_summation_order(runs):
    (dense, dense_losses), (fact, fact_losses) = runs["dense"], runs["factored"]
    # float32 sums of at most 10 products regrouped ((x A) B vs x (A B), x^T (d B^T) vs
    # (x^T d) B^T): a few ulps of each sum; two steps of a linear optimizer keep it so
    np.testing.assert_allclose(fact_losses, dense_losses, rtol=1e-6)
    for path, a in jax.tree_util.tree_leaves_with_path(dense):
        b = jax.tree_util.tree_leaves_with_path(fact)
        b = dict((jax.tree_util.keystr(p), v) for p, v in b)[jax.tree_util.keystr(path)]
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))  # fmt: skip
    initial = runs["params"]["tall"]["kernel"]
    moved = np.abs(np.asarray(fact.params["tall"]["kernel"]) - initial).max()
    assert moved > 1e-3  # the steps did train


def test_the_factored_ab_program_does_fewer_operations(runs):
    flops = runs["flops"]
    assert flops["factored"] < flops["dense"], flops


def test_the_hook_computes_a_dense_layer_from_factors_only_where_cheaper():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((8, 6), np.float32), rng.standard_normal((6, 6), np.float32)
    kernel = jnp.asarray(a @ b)
    layer, params = nn.Dense(6), {"params": {"kernel": kernel, "bias": jnp.ones(6)}}
    poisoned = Factors(jnp.full((8, 6), jnp.nan), jnp.asarray(b), transposed=False)
    for rows, used in ((1, True), (64, False)):  # at full capacity: cheaper for 1 row, not 64
        assert cheaper(rows, 8, 6, 6) is used
        x = jnp.asarray(rng.standard_normal((rows, 8)), jnp.float32)
        with models.factored_dense({id(kernel): poisoned}):
            y = layer.apply(params, x)
        assert bool(jnp.isnan(y).any()) is used  # the (NaN) factors were read only if cheaper
    with models.factored_dense({id(kernel): Factors(jnp.asarray(a), jnp.asarray(b), False)}):
        y = layer.apply(params, x[:1])
    np.testing.assert_allclose(y, x[:1] @ kernel + 1.0, rtol=1e-6, atol=1e-6)
    with models.factored_dense({id(kernel): poisoned}):  # another module type: left alone
        y = nn.DenseGeneral(6).apply(params, x[:1])
    assert not bool(jnp.isnan(y).any())


@pytest.mark.parametrize("transposed", [False, True])
def test_factors_multiply_as_their_kernel(transposed):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((10, 4), np.float32), rng.standard_normal((4, 6), np.float32)
    kernel = (a @ b).T if transposed else a @ b  # [6, 10] (a wide layer's) or [10, 6]
    x = rng.standard_normal((3, 2, kernel.shape[0]), np.float32)
    got = Factors(jnp.asarray(a), jnp.asarray(b), transposed).matmul(jnp.asarray(x))
    np.testing.assert_allclose(got, x @ kernel, rtol=1e-5, atol=1e-5)
