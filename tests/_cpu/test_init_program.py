"""jit_split_init: a state init compiled as a fast key part and a default-compiled float part
gives ``jax.jit(fn)``'s bits, in every context it is called in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import models
from jaxcomp._compile import compile_all
from jaxcomp._cpu import _init_program
from jaxcomp.train import _mode

#: every registered model, small (the digits MLP at the trainer tests' size; the convolutional
#: ones at the fewest channels their layers take: the reference's compile, most of these tests'
#: time, grows with the channels), BatchNorm where the model has it (its statistics' ones and
#: zeros); the initializers on large shapes: test_the_initializers_have_the_default_compiles_bits
SMALL = {
    "mlp": lambda: models.mlp(hidden=(32, 32, 32)),
    "small_cnn": lambda: models.small_cnn(channels=(2, 2), hidden=4),
    "resnet18": lambda: models.resnet18(width=2, blocks=(1,), norm="batch", cuts=("stem",)),
    "vgg16": lambda: models.vgg16(width_divisor=64, cuts=("block2", "block4")),
    # one block: a second one adds the same layers (its pin 3.0 -> 2.4 s of CPU)
    "gpt": lambda: models.gpt(seq_len=8, dim=16, num_heads=2, num_blocks=1, cuts=()),
    # NNX's RNG streams fold in counts computed between two hashes (grouped out of order
    # until 2026-12-05: a KeyError at the key part's trace)
    "nnx_mlp": lambda: models.nnx_mlp(hidden=(32, 32, 32)),
}
#: models whose init is pinned through another's: VGG-16's layers (``nn.Conv`` with a bias,
#: ``nn.Dense``; lecun_normal kernels, zero biases, small shapes) are the small CNN's, whose
#: pin compiles in 1.5 s where VGG-16's 13 convs took 6 s; so are ResNet-18's (its convs
#: without a bias, its BatchNorms' scales, biases and statistics constant ones and zeros as
#: the CNN's biases are: its own pin took 2.0 s of the fusion-emitter runner's CPU);
#: test_a_covered_models_init_holds_nothing_its_coverer_does_not checks the claim on the
#: traced inits
COVERED_BY = {"vgg16": "small_cnn", "resnet18": "small_cnn"}
#: ``{name: (model, its coverer)}`` of the inits pinned through another's: the covered models,
#: and ResNet-18 with a second layer (stride 2, a projection shortcut: three more convolutions
#: and BatchNorms of other shapes)
COVERAGE = {
    **{name: (SMALL[name], coverer) for name, coverer in COVERED_BY.items()},
    "resnet18_two_layers": (
        lambda: models.resnet18(width=2, blocks=(1, 1), norm="batch", cuts=("stem",)),
        "small_cnn",
    ),
}

#: models pinned in one program: the Linen and the NNX MLP have the same layers, whose kernels
#: a program compiles once (the two references' compiles 2.5 -> 1.4 s)
PINNED_TOGETHER = {"mlp": ("mlp", "nnx_mlp")}
PINS = [
    PINNED_TOGETHER.get(n, (n,))
    for n in sorted(set(SMALL) - set(COVERED_BY) - {m for g in PINNED_TOGETHER.values() for m in g})
] + list(PINNED_TOGETHER.values())


def _assert_same_bits(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert a.dtype == b.dtype
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _is_split(init, *args):
    return init.lower(*args).plain is None


def test_every_registered_model_is_covered():
    assert set(SMALL) == set(models.MODELS)
    assert set(COVERED_BY.values()) <= set(SMALL) - set(COVERED_BY)
    pinned = [n for names in PINS for n in names]  # each once, with the group it compiles in
    assert sorted(pinned) == sorted(set(SMALL) - set(COVERED_BY))


def _primitives(jaxpr, out=None):
    """``{(primitive, its scalar parameters), ...}`` of a jaxpr and the jaxprs in its
    parameters: without shapes and axes (tuples), with dtypes, bit widths, flags."""
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        scalars = sorted(
            (k, repr(v))
            for k, v in eqn.params.items()
            if not isinstance(v, (tuple, list)) and not hasattr(getattr(v, "jaxpr", v), "eqns")
        )
        out.add((eqn.primitive.name, str(scalars)))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    _primitives(sub, out)
    return out


@pytest.mark.parametrize("name", sorted(COVERAGE))
def test_a_covered_models_init_holds_nothing_its_coverer_does_not(name):
    """The model's init (traced, nested ``jit`` inlined as the split does) uses no primitive
    that the model pinning it does not (with the same dtypes and flags), and it splits (both
    parts traced and lowered, not compiled)."""
    key = jax.random.key(0)
    make, coverer = COVERAGE[name]
    covered, pinned = (
        _primitives(_init_program._flat_jaxpr(m().init, (key,))[0].jaxpr)
        for m in (make, SMALL[coverer])
    )
    assert covered <= pinned, covered - pinned
    assert _is_split(_mode.jit_init(make().init), key)


@pytest.mark.user_numerics
@pytest.mark.parametrize(
    "names",
    [pytest.param(g, id="+".join(g), marks=[] if "mlp" in g else [pytest.mark.slow]) for g in PINS],
)
def test_every_models_init_has_the_default_compiles_bits(names):
    made = {n: SMALL[n]() for n in names}

    def init_all(key):
        return {n: model.init(key) for n, model in made.items()}

    key = jax.random.key(0)
    init = _mode.jit_init(init_all)
    assert _is_split(init, key)
    variables = init(key)
    _assert_same_bits(variables, jax.jit(init_all)(key))
    for n in names:
        assert any(np.std(np.asarray(x)) > 0.005 for x in jax.tree.leaves(variables[n])), n


@pytest.mark.user_numerics
@pytest.mark.slow
def test_the_initializers_have_the_default_compiles_bits_on_small_and_large_shapes():
    """The initializers the models use (Dense/Conv: lecun_normal, GPT: normal(0.02)) on large
    shapes (vectorised at XLA's default level), and one no model uses on a small and a larger
    shape. Small ones (loops unrolled: each shape a kernel of its own, ~0.5 s of the reference's
    compile) are the models' above: the MLP's and the CNN's Dense and Conv kernels, 18 to 2048
    entries, GPT's embeddings."""
    inits = {
        "lecun_normal": (nn.initializers.lecun_normal(), [(1024, 64)]),
        "normal": (nn.initializers.normal(0.02), [(2048, 32)]),
        "uniform": (nn.initializers.uniform(1.0), [(5,), (300, 7)]),
    }

    def init(key):
        out = {}
        for i, (name, (fn, shapes)) in enumerate(inits.items()):
            for j, shape in enumerate(shapes):
                out[f"{name}{shape}"] = fn(jax.random.fold_in(key, 10 * i + j), shape)
        return out

    key = jax.random.key(3)
    fast = _mode.jit_init(init)
    assert _is_split(fast, key)
    got = fast(key)
    _assert_same_bits(got, jax.jit(init)(key))
    for name, x in got.items():
        assert np.std(np.asarray(x)) > 0.005, name  # random, not a constant


def _mixed(key):
    """Draws and keys out, from a typed or a raw uint32 key."""
    a, b = jax.random.split(key)
    return {
        "w": jax.random.normal(a, (5, 3)),
        "u": jax.random.uniform(b, (7,), minval=-1e-10, maxval=1e6),
        "t": jax.random.truncated_normal(a, -2.0, 2.0, (9,)),
        "bits": jax.random.bits(b, (4,)),
        "next": jax.random.split(b)[0],
        "count": jnp.int32(0),
    }


#: ``_mixed`` split and plain, each made once: the tests below call them with other keys (the
#: same programs, compiled once for a key type)
_MIXED_SPLIT = functools.cache(lambda: _init_program.jit_split_init(_mixed))
_MIXED_JIT = jax.jit(_mixed)


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_typed_and_raw_keys_in_and_out(make_key):
    key = make_key(7)
    init = _MIXED_SPLIT()
    assert _is_split(init, key)
    _assert_same_bits(init(key), _MIXED_JIT(key))


def test_an_init_without_a_key_part_is_one_plain_program():
    def no_randomness(x):
        return {"w": jnp.ones((3, 2)) * x, "n": jnp.arange(3)}

    def integers_only(key):
        return jax.random.bits(key, (3,)), jax.random.split(key)

    x, key = jnp.float32(2.5), jax.random.key(1)
    for fn, arg in [(no_randomness, x), (integers_only, key)]:
        init = _init_program.jit_split_init(fn)
        assert not _is_split(init, arg)
        _assert_same_bits(init(arg), jax.jit(fn)(arg))


def test_with_xla_optimisations_off_it_is_one_plain_program_kept_apart():
    """Under ``jax_disable_most_optimizations`` (the test suite's ``fast_compiles``) the whole
    init compiles at level 0: one program, 0.1-0.2 s faster than two; a call outside it does
    not reuse that program."""
    init = _MIXED_SPLIT()
    key = jax.random.key(6)
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        assert not _is_split(init, key)
        init(key)
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
    assert _is_split(init, key)
    _assert_same_bits(init(key), _MIXED_JIT(key))


def test_other_jit_arguments_give_one_plain_program():
    def draw(key, n):
        return jax.random.normal(key, (n,))

    key = jax.random.key(4)
    init = _init_program.jit_split_init(draw, static_argnums=1)
    assert not _is_split(init, key, 5)
    _assert_same_bits(init(key, 5), jax.jit(draw, static_argnums=1)(key, 5))


def test_an_error_in_the_init_surfaces_as_from_jax_jit():
    def broken(key):
        w = jax.random.normal(key, (3, 4))
        return w @ jnp.ones((5, 2))

    key = jax.random.key(0)
    with pytest.raises(TypeError) as plain:
        jax.jit(broken)(key)
    init = _init_program.jit_split_init(broken)
    for run in (lambda: init(key), lambda: init.lower(key)):
        with pytest.raises(TypeError) as split:
            run()
        assert str(split.value) == str(plain.value)


def test_inside_a_trace_it_is_the_callers_program():
    """Inside ``jit``, ``shard_map`` or ``eval_shape`` the init is traced into the caller's
    program; those programs' draws equal the split program's."""
    init = _MIXED_SPLIT()
    key = jax.random.key(5)
    direct = init(key)
    _assert_same_bits(jax.jit(lambda k: init(k))(key), direct)
    mesh = jax.make_mesh((8,), ("x",))
    in_map = jax.shard_map(lambda k: init(k)["w"], mesh=mesh, in_specs=P(), out_specs=P())
    _assert_same_bits(jax.jit(in_map)(key), direct["w"])
    shapes = jax.eval_shape(init, key)
    assert shapes["w"].shape == (5, 3) and shapes["bits"].dtype == jnp.uint32


@pytest.mark.user_numerics
def test_the_key_part_gives_the_same_integers_at_every_compile_level_and_eagerly():
    """What makes the split exact: A's outputs are integers (and keys), the same compiled at
    the low level, at XLA's default, or run op by op."""
    key = jax.random.key(0)
    lowered = _init_program.jit_split_init(_mixed).lower(key)
    part = lowered.key_part
    low = jax.jit(part, compiler_options=_init_program.LOW_OPTIONS)(key)
    assert low and all(not jnp.issubdtype(x.dtype, jnp.floating) for x in low)
    _assert_same_bits(low, jax.jit(part)(key))
    with jax.disable_jit():
        _assert_same_bits(low, part(key))


def test_out_shardings_on_a_mesh_outside_and_inside_it():
    mesh = jax.make_mesh((8,), ("x",))
    shardings = {"w": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P())}

    def init(key):
        a, b = jax.random.split(key)
        return {"w": nn.initializers.lecun_normal()(a, (64, 16)), "b": jax.random.normal(b, (16,))}

    key = jax.random.key(2)
    for out_shardings in (shardings, NamedSharding(mesh, P())):
        want = jax.jit(init, out_shardings=out_shardings)(key)
        for context in (jax.set_mesh(mesh), _null()):
            with context:
                fast = _mode.jit_init(init, out_shardings=out_shardings)
                assert _is_split(fast, key)
                got = fast(key)
            _assert_same_bits(got, want)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert g.sharding.is_equivalent_to(w.sharding, g.ndim)


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_a_call_after_compile_all_compiles_and_traces_nothing():
    """As the trainer's setup: lowered on an abstract key, compiled beside other programs,
    then called with a real key (a one-layer MLP: its reference compile is this test's
    largest part; the registered models' bits are pinned above)."""
    model = models.mlp(hidden=(8,))
    init = _mode.jit_init(model.init)
    key_abs = jax.eval_shape(jax.random.key, 0)
    other = jax.jit(lambda x: x + 1).lower(jnp.zeros(2))
    compile_all({"init": init.lower(key_abs), "other": other})
    events = []

    def listener(event, duration, **_):
        del duration
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        variables = init(jax.random.key(0))
        jax.block_until_ready(variables)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    compiling = {"jaxpr_trace_duration", "jaxpr_to_mlir_module_duration",
                 "backend_compile_duration"}  # fmt: skip
    compiles = [e for e in events if e.rsplit("/", 1)[-1] in compiling]
    assert not compiles, compiles
    _assert_same_bits(variables, jax.jit(model.init)(jax.random.key(0)))
