"""Staged models: cut points, stage functions == the whole model, sizes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp import models
from jaxcomp.models import _staged

#: each test compares two programs compiled alike (stages == the whole model, to a tolerance) or
#: checks shapes and counts, not the bits of XLA's optimised program: compiled unoptimised, the
#: ResNet-18 / VGG-16 programs take ~1/5 of the compile time
pytestmark = pytest.mark.usefixtures("fast_compiles")

TINY = {
    "mlp": lambda: models.mlp(hidden=(16, 16, 16)),
    "small_cnn": lambda: models.small_cnn(channels=(4, 8), hidden=16),
    "resnet18": lambda: models.resnet18(width=8, blocks=(1, 1, 1, 1), norm="group"),
    "vgg16": lambda: models.vgg16(width_divisor=16, cuts=("block2", "block4")),
    "gpt": lambda: models.gpt(
        seq_len=8, dim=16, num_heads=2, num_blocks=3, cuts=("block0", "block1")
    ),
}


def _variables(model, seed=0):
    """Variables of ``model.init``'s structure drawn with numpy (weights scaled by their fan-in,
    norm scales near 1, running variances in [0.5, 1.5]): these tests need any values of the
    right tree, and a compiled init costs ~1 s per model (``tests/_cpu/test_init_program.py``
    pins init's own bits)."""
    rng = np.random.default_rng(seed)

    def draw(path, like):
        name = getattr(path[-1], "key", None)
        if name == "var":
            return rng.uniform(0.5, 1.5, like.shape).astype(like.dtype)
        if like.ndim < 2:
            return (0.1 * rng.normal(size=like.shape) + (name == "scale")).astype(like.dtype)
        return (rng.normal(size=like.shape) / np.sqrt(np.prod(like.shape[:-1]))).astype(like.dtype)

    return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(model.init, jax.random.key(0)))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_stage_fns_compose_to_the_whole_model(name):
    model = TINY[name]()
    rng = np.random.default_rng(1)
    if model.input_dtype == jnp.int32:
        x = rng.integers(0, model.num_outputs, (3, *model.input_shape)).astype(np.int32)
    else:
        x = rng.normal(size=(3, *model.input_shape)).astype(np.float32)

    variables = _variables(model)

    @jax.jit  # one program for both sides
    def whole_and_staged(variables, h):
        whole = model.apply(variables, h)[0]
        for fn, v in zip(model.stage_fns(train=False), variables):
            h = fn(v["params"], h)
        return whole, h

    y_whole, h = whole_and_staged(variables, x)
    assert np.isfinite(y_whole).all()
    np.testing.assert_allclose(h, y_whole, rtol=1e-6, atol=1e-6)
    expected = (3, 8, 256) if name == "gpt" else (3, 10)
    assert y_whole.shape == expected
    assert len(variables) == model.num_stages == len(model.cuts) + 1 >= 2


def test_paper_cut_points_and_boundary_shapes():
    resnet = models.resnet18(norm="group")
    assert resnet.cuts == ("layer1", "layer2", "layer3")
    shapes = [s.shape for s in resnet.boundary_shapes(2)]
    assert shapes == [(2, 32, 32, 64), (2, 16, 16, 128), (2, 8, 8, 256)]
    lm = models.gpt(seq_len=16, dim=32, num_heads=4)
    assert lm.cuts == ("block2", "block5", "block8") and lm.num_stages == 4
    assert [s.shape for s in lm.boundary_shapes(2)] == [(2, 16, 32)] * 3
    assert models.mlp().num_stages == 4 and models.small_cnn().num_stages == 4


def test_reference_parameter_counts():
    def count(model):
        shapes = jax.eval_shape(model.init, jax.random.key(0))
        return sum(int(np.prod(x.shape)) for v in shapes for x in jax.tree.leaves(v["params"]))

    assert count(models.resnet18()) == 11_173_962  # kuangliu/pytorch-cifar ResNet18
    assert count(models.vgg16()) == 14_719_818  # 13 convs + Linear(512, 10), no BN


def test_batchnorm_statistics_update_in_training_and_block_pipelining():
    model = models.resnet18(width=8, blocks=(1, 1), norm="batch", cuts=())
    variables = _variables(model)
    x = np.random.default_rng(1).normal(size=(4, 32, 32, 3)).astype(np.float32)
    _, new = jax.jit(lambda v, x: model.apply(v, x, train=True))(variables, x)
    before = jax.tree.leaves(variables[0]["batch_stats"])
    after = jax.tree.leaves(new[0]["batch_stats"])
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="stateful_stage_fns"):
        model.stage_fns()


BN = {
    "resnet18": lambda: models.resnet18(width=8, blocks=(1, 1), cuts=("stem", "layer1")),
    "vgg16": lambda: models.vgg16(width_divisor=16, norm="batch", cuts=("block1", "block4")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BN))
def test_stateful_stage_fns_compose_to_the_whole_batchnorm_model(name):
    """Training: outputs and updated statistics of the chained stages == the whole model's;
    evaluation: the running statistics."""
    model = BN[name]()
    assert model.stateful and model.has_batch_stats
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, *model.input_shape)), jnp.float32)

    @jax.jit
    def run(variables, x):
        whole = model.apply(variables, x, train=True)
        h, h_eval, stats = x, x, []
        fns = zip(model.stateful_stage_fns(True), model.stateful_stage_fns(False), variables)
        for train_fn, eval_fn, v in fns:
            state = {k: c for k, c in v.items() if k != "params"}
            h_eval = eval_fn(v["params"], state, h_eval)
            h, new = train_fn(v["params"], state, h)
            stats.append(new)
        return whole, (h, tuple(stats)), model.apply(variables, x)[0], h_eval

    (y, new), (h, stats), y_eval, h_eval = run(_variables(model), x)
    assert np.isfinite(y).all() and np.isfinite(y_eval).all()
    np.testing.assert_allclose(h, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_eval, y_eval, rtol=1e-5, atol=1e-6)
    want = tuple({k: c for k, c in v.items() if k != "params"} for v in new)
    for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert jax.tree.structure(stats) == jax.tree.structure(want)


def test_vgg16_batchnorm_is_kuangliu_vgg16():
    shapes = jax.eval_shape(models.vgg16(norm="batch").init, jax.random.key(0))
    assert sum(int(np.prod(x.shape)) for v in shapes for x in jax.tree.leaves(v["params"])) == (
        14_728_266  # kuangliu/pytorch-cifar VGG('VGG16'): 13 x (conv + BN) + Linear(512, 10)
    )
    stats = jax.tree.leaves([v["batch_stats"] for v in shapes])
    assert sum(x.size for x in stats) == 2 * 4224  # a running mean and variance per channel
    with pytest.raises(ValueError, match="norm must be one of"):
        models.vgg16(norm="instance")


def test_bad_names_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown model 'resnet50'"):
        models.get_model("resnet50")
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['depth'\]"):
        models.get_model("mlp", depth=3)
    with pytest.raises(ValueError, match="unknown cut point 'layer9'"):
        models.resnet18(cuts=("layer9",))
    with pytest.raises(ValueError, match="in model order"):
        models.resnet18(cuts=("layer3", "layer1"))
    with pytest.raises(ValueError, match="norm must be one of"):
        models.resnet18(norm="instance")


def test_segment_names_must_be_distinct():
    """A parameter is named by its segment (metrics, ``exclude``, cut points): two segments of
    one name would make two parameters one name."""
    block = models.mlp().segments[0][1]
    with pytest.raises(ValueError, match=r"segment names must be distinct; 'fc' appears 2 times"):
        _staged.make_staged("twin", [("fc", block), ("fc", block), ("head", block)], None, (),
                            input_shape=(64,), input_dtype=jnp.float32, num_outputs=10,
                            task="classification")  # fmt: skip
