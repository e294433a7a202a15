"""The finiteness flags of :mod:`jaxcomp._finite`: per worker (``all_finite``, the parallel
drivers') and over a global-view state (``all_finite_global``, the trainer's modes).

``all_finite`` sums ``0 * x`` over the leaves of each dtype, concatenated; these tests hold it
(and ``all_finite_global``) to the per-leaf reference (``np.isfinite(leaf).all()`` for every
inexact leaf) at the edges (NaN, infinities, the largest finite values, subnormals, signed
zeros, bf16/f16, empty leaves, scalars, int leaves ignored), in every context it runs in
(eager, jit, shard_map with a flag per worker, a state placed on a mesh), and pin the compiled
form: a few reductions, whatever the number of leaves.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _finite

EDGES = [np.nan, np.inf, -np.inf]
FINITE_EDGES = [0.0, -0.0, 1e-10, -1e-10, 1e6, -1e6, 3.0e38, -3.0e38, 1e-45]


def _reference(tree, *scalars) -> int:
    leaves = [np.asarray(x) for x in jax.tree.leaves((tree, scalars))]
    inexact = [x for x in leaves if np.issubdtype(x.dtype, np.inexact) or x.dtype == jnp.bfloat16]
    return int(all(np.isfinite(x.astype(np.float32)).all() for x in inexact))


def _tree(rng, bad_leaf=None, bad_value=None, position=0):
    """Leaves of several shapes and dtypes (ints, bf16, f16, zero-size, scalars), every
    finite edge value present; ``bad_value`` put at ``position`` of leaf ``bad_leaf``."""
    leaves = [
        rng.standard_normal((3, 5)).astype(np.float32),
        np.asarray(FINITE_EDGES, np.float32),
        rng.standard_normal((7,)).astype(jnp.bfloat16),
        np.asarray([65504.0, -65504.0, 6e-8, 0.0], np.float16),
        np.zeros((0, 4), np.float32),
        np.float32(2.5),
        rng.standard_normal((2, 2, 2)).astype(np.float32),
        rng.standard_normal((300, 257)).astype(np.float32),  # past XLA's reduction split
    ]
    if bad_leaf is not None:
        x = leaves[bad_leaf].copy().reshape(-1)
        x[position % x.size] = bad_value
        leaves[bad_leaf] = x.reshape(np.shape(leaves[bad_leaf]))
    ints = np.asarray([np.iinfo(np.int32).max, np.iinfo(np.int32).min], np.int32)
    return {"f": leaves[:4], "empty": leaves[4], "scalar": leaves[5], "n": ints,
            "nested": {"g": leaves[6], "big": leaves[7]}}  # fmt: skip


CASES = [(None, None, 0)] + [
    pytest.param(leaf, value, pos, marks=[pytest.mark.slow] if pos == 3 else [])
    for leaf in (0, 1, 2, 3, 5, 6, 7)
    for value in EDGES
    for pos in (0, 3, -1)
]  # the fast tier: each leaf's first and last entry; the slow tier also one inside


#: replicated -> ``all_finite_global`` with it; one function each for the module, so that
#: every case's tree (the same shapes) runs the program the first case compiled
GLOBAL = {r: functools.partial(_finite.all_finite_global, replicated=r) for r in (True, False)}
GLOBAL_JIT = {r: jax.jit(check) for r, check in GLOBAL.items()}


@pytest.mark.user_numerics
@pytest.mark.parametrize("leaf,value,pos", CASES)
def test_matches_the_per_leaf_reference_eager_and_jit(leaf, value, pos):
    tree = _tree(np.random.default_rng(0), leaf, value, pos)
    want = _reference(tree)
    assert want == (1 if leaf is None else 0)  # the case is real
    assert int(_finite.all_finite(tree)) == want
    assert int(jax.jit(_finite.all_finite)(tree)) == want
    for replicated in (True, False):
        assert bool(GLOBAL[replicated](tree)) == bool(want)
        assert bool(GLOBAL_JIT[replicated](tree["f"], tree)) == bool(want)


@pytest.mark.parametrize("value", EDGES)
def test_a_scalar_alone_decides(value):
    tree = _tree(np.random.default_rng(1))
    assert int(jax.jit(_finite.all_finite)(tree, jnp.float32(1e6))) == 1
    assert int(jax.jit(_finite.all_finite)(tree, jnp.float32(1e6), jnp.float32(value))) == 0


def test_no_inexact_leaf_is_finite():
    assert int(_finite.all_finite(())) == 1
    assert int(_finite.all_finite({"n": jnp.arange(3)})) == 1
    assert int(jax.jit(_finite.all_finite)({"e": jnp.zeros((0,))})) == 1
    assert _finite.all_finite(()).dtype == jnp.int32


@pytest.mark.user_numerics
def test_one_flag_per_worker_in_shard_map_without_a_collective():
    mesh = jax.make_mesh((8,), ("w",), devices=jax.devices()[:8])
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 16, 3)).astype(np.float32)
    b = rng.standard_normal((8, 5)).astype(jnp.bfloat16)
    a[2, 7, 1], a[5, 0, 0], b[6, 4] = np.nan, -np.inf, np.inf
    # worker 3: huge but finite values; worker 7: a non-finite replicated scalar is not its own
    a[3] = 3.0e38

    def body(a, b, s):
        return _finite.all_finite({"a": a, "b": (b,)}, s)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("w"), P("w"), P()), out_specs=P("w")))
    shard = NamedSharding(mesh, P("w"))
    args = (jax.device_put(a, shard), jax.device_put(b, shard), jnp.float32(1.0))
    assert np.asarray(fn(*args)).tolist() == [1, 1, 0, 1, 1, 0, 0, 1]
    assert np.asarray(fn(*args[:2], jnp.float32(np.nan))).tolist() == [0] * 8
    text = fn.lower(*args).compile().as_text()
    assert not any(op in text for op in ("all-reduce", "all-gather", "collective-permute"))


@pytest.mark.parametrize("leaf", [0, 1, 2, 3, 4])
def test_groups_past_the_size_limit(leaf):
    # one leaf larger than a group (tested alone), several that fill more than one group
    n = _finite.FINITE_GROUP_SIZE
    sizes = [n + 5, n // 2, n // 2 + 1, n // 2, 11]  # groups: [0], [1], [2], [3, 4]
    rng = np.random.default_rng(3)
    tree = [rng.standard_normal(k).astype(np.float32) for k in sizes]
    assert len(_finite.capped_groups([jnp.asarray(x) for x in tree])) == 4
    f = jax.jit(_finite.all_finite)
    assert int(f(tree)) == 1
    tree[leaf][-1] = np.nan
    assert int(f(tree)) == 0


@pytest.mark.user_numerics
def test_the_temporary_stays_small_for_a_large_state():
    # a step that writes 64 MiB of state and checks it: the concatenation is a temporary of
    # at most about a group, not of the whole state (past 32 MiB glibc gives fresh pages)
    shapes = [(4096, 512)] * 8 + [(3000,)] * 20
    ps = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

    def step(p):
        new = jax.tree.map(lambda x: x * 2.0 - 1.0, p)
        return new, _finite.all_finite(new)

    temp = jax.jit(step).lower(ps).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 16 * 2**20


def _reductions(n_leaves: int) -> int:
    shapes = [(64 * (i + 1), 256) for i in range(n_leaves)]
    tree = [jnp.ones(s, jnp.float32) for s in shapes] + [jnp.ones((4,), jnp.bfloat16)]
    text = jax.jit(_finite.all_finite).lower(tree).compile().as_text()
    return sum(" reduce(" in line or "reduce-window(" in line for line in text.splitlines())


def test_compiles_to_a_few_reductions_whatever_the_leaf_count():
    # one sum per dtype (f32, bf16) and the flags' ``all``, not one test per leaf (the
    # per-leaf check: 25 here, and about three kernels per leaf shape in a program)
    assert _reductions(2) <= 3 and _reductions(12) <= 3


@pytest.mark.user_numerics
@pytest.mark.parametrize("value", [complex(np.inf, 0), complex(0, np.nan), complex(1, -np.inf)])
def test_complex_leaves_either_part(value):
    ok = np.asarray([1 + 2j, 3e38 - 3e38j, 0j], np.complex64)
    bad = ok.copy()
    bad[1] = value
    assert int(jax.jit(_finite.all_finite)({"c": ok, "r": jnp.ones(3)})) == 1
    assert int(jax.jit(_finite.all_finite)({"c": bad, "r": jnp.ones(3)})) == 0


def test_global_flag_over_a_placed_state_without_resharding():
    # replicated leaves (the dense mode's state): tested in groups, no collective at all;
    # sharded leaves: one test each, a bad element in any shard found
    mesh = jax.make_mesh((8,), ("w",), devices=jax.devices()[:8])
    rng = np.random.default_rng(4)
    tree = {"a": rng.standard_normal((16, 8)).astype(np.float32), "b": np.ones(5, np.float32)}
    rep = jax.device_put(tree, NamedSharding(mesh, P()))
    grouped = jax.jit(functools.partial(_finite.all_finite_global, replicated=True))
    text = grouped.lower(rep).compile().as_text()
    assert not any(op in text for op in ("all-reduce", "all-gather", "all-to-all"))
    assert bool(grouped(rep))
    bad = dict(tree, a=tree["a"].copy())
    bad["a"][13, 2] = np.inf  # in the 7th of 8 shards
    assert not bool(grouped(jax.device_put(bad, NamedSharding(mesh, P()))))
    shard = {"a": NamedSharding(mesh, P("w")), "b": NamedSharding(mesh, P())}
    per_leaf = jax.jit(_finite.all_finite_global)
    assert bool(per_leaf(jax.device_put(tree, shard)))
    assert not bool(per_leaf(jax.device_put(bad, shard)))
    assert "all-gather" not in per_leaf.lower(jax.device_put(tree, shard)).compile().as_text()
