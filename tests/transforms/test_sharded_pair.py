"""compressed_mean and accordion with ``shard_fast=True`` on a 2 x 4 (slow, fast) mesh: each
parameter reduced over the slow axis by one device of its host (its owner), the means gathered
over the fast axis. == the unsharded hierarchical mean bit for bit over several steps (the
owners' states too; the other devices' copies untouched), and the slow links carry each payload
once per host instead of 4 times (the HLO meter)."""

import jax
import numpy as np
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import transforms as T
from jaxcomp.comm import _reduce_shards

SLOW, FAST = "slow", "fast"
PAIR = (SLOW, FAST)
#: four compressed matrices of different sizes (so that all four devices own one) and a bias
SHAPES = {"a": (16, 8), "b": (8, 8), "c": (12, 8), "d": (8, 4), "bias": (8,)}
SCALES = (1.0, 1.0, 3.0, 3.0)  # accordion: interval norms first, same, x3, same -> modes switch
#: ulps of an array's largest magnitude the sharded run may differ by. compressed_mean's PowerSGD
#  runs in the main computation unsharded and inside a switch branch sharded, where XLA:CPU
#  fuses its products and orthogonalisation differently (up to 1.1e-7 of the largest entry
#  over 4 steps, 2026-12-05); Accordion's PowerSGD sits in a cond branch either way: exact
ULPS = {"power_sgd_ef": 4, "top_k_ef": 0, "accordion": 0}
#: the parameters of a case (default: all of SHAPES). Accordion's two PowerSGD ranks under a
#  cond compile per parameter (seconds each program): two matrices, owned by devices 0 and 1,
#  so that 2 and 3 own nothing (every device owning one: the compressed_mean cases)
NAMES = {"accordion": ("a", "c", "bias")}


def _accordion(shard):
    return T.accordion(C.power_sgd(2), C.power_sgd(1), interval_steps=1, check_every=1,
                       axis_name=PAIR, shard_fast=shard)  # fmt: skip


CASES = {
    "power_sgd_ef": lambda shard: T.compressed_mean(
        F.error_feedback(C.power_sgd(2)), PAIR, shard_fast=shard
    ),
    "top_k_ef": lambda shard: T.compressed_mean(
        F.error_feedback(C.top_k(0.25)), PAIR, shard_fast=shard
    ),
    "accordion": _accordion,
}


@pytest.fixture(scope="module")
def grads():
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal((8, *s)).astype(np.float32) for k, s in SHAPES.items()}


@pytest.fixture(scope="module")
def runs(pair_mesh, grads, pair_update):
    """Per case and sharding: (initial state, [(means, state)] over the steps, step, g)."""

    def run(case, shard):
        case_grads = {k: grads[k] for k in NAMES.get(case, SHAPES)}
        step, state, sharding = pair_update(CASES[case](shard), pair_mesh, PAIR, PAIR, case_grads)
        first, out = state, []
        for scale in SCALES:
            g = jax.device_put(jax.tree.map(lambda x, c=scale: x * c, case_grads), sharding)
            mean, state = step(g, state)
            out.append((mean, state))
        return first, out, step, g

    cache = {}

    def cached(case, shard):  # (a dict.setdefault ran every case again on each call)
        if (case, shard) not in cache:
            cache[case, shard] = run(case, shard)
        return cache[case, shard]

    return cached


def _reduction_states(state):
    """Each parameter's state of its reduction: ``{name: tree}``."""
    if isinstance(state, T.AccordionState):
        return {
            k: (leaf.memory, leaf.low, leaf.high)
            for k, leaf in state.leaves.items()
            if isinstance(leaf, T.AccordionLeaf)
        }
    return dict(state.leaves)


def _assert_close(actual, desired, ulps, err_msg):
    """Equal to ``ulps`` float32 ulps of ``desired``'s largest magnitude (0: bit for bit)."""
    if ulps == 0:
        np.testing.assert_array_equal(actual, desired, err_msg=err_msg)
    else:
        scale = np.abs(desired).max() if desired.size else 0.0
        atol = ulps * np.finfo(np.float32).eps * scale
        np.testing.assert_allclose(actual, desired, rtol=0, atol=atol, err_msg=err_msg)


def _assert_same_state(unsharded, sharded, owner, names, ulps):
    for name in names:
        u_leaves = jax.tree.leaves(unsharded[name])
        s_leaves = jax.tree.leaves(sharded[name])
        for u, s in zip(u_leaves, s_leaves, strict=True):
            u, s = np.asarray(u), np.asarray(s)[:, owner[name]]  # [W_slow, ...] of the owner
            if s.shape[1:2] == (1,) and s.shape[2:] == u.shape[1:]:  # per worker: [W_slow, 1, ..]
                _assert_close(s[:, 0], u, ulps, name)
            else:  # replicated: every slow worker's copy equals it
                for copy in s:
                    _assert_close(copy, u, ulps, name)


def _owned_states(state):
    """``{name: tree}`` of the sharded state's PerDevice parts (accordion: the three owned)."""
    out = {}
    for name, part in _reduction_states(state).items():
        parts = (part,) if isinstance(part, comm.PerDevice) else part
        assert all(isinstance(p, comm.PerDevice) for p in parts), name
        out[name] = [p.value for p in parts]
    return out


@pytest.mark.user_numerics
@pytest.mark.parametrize(
    "case", ["power_sgd_ef", "top_k_ef", pytest.param("accordion", marks=pytest.mark.slow)]
)
def test_sharded_equals_unsharded(case, runs, grads):
    """The same means on every step (bit for bit, or to ULPS), the owners' states == the
    unsharded ones, the other devices' copies as init left them, and the same bytes_sent (a
    host's, over slow)."""
    _, plain, _, _ = runs(case, False)
    first, sharded, _, _ = runs(case, True)
    names = list(NAMES.get(case, SHAPES))
    owner = dict(
        zip(names, _reduce_shards.owners([jax.ShapeDtypeStruct(SHAPES[k], np.float32) for k in
                                          names], 4))
    )  # fmt: skip
    matrices = sorted(owner[k] for k in names if k != "bias")
    assert matrices == list(range(len(matrices)))  # devices 0.. own a matrix each
    for (m0, s0), (m1, s1) in zip(plain, sharded):
        for k in names:
            _assert_close(np.asarray(m1[k]), np.asarray(m0[k]), ULPS[case], k)
        assert float(s1.bytes_sent) == float(s0.bytes_sent)
        unsharded = {k: jax.tree.map(np.asarray, v) for k, v in _reduction_states(s0).items()}
        owned = _owned_states(s1)
        _assert_same_state(unsharded, owned, owner, list(owned), ULPS[case])
        if case == "accordion":  # the group's part of the state is the same
            modes = T.accordion_metrics(s1)["modes"]
            assert modes == T.accordion_metrics(s0)["modes"]
    init = _owned_states(first)
    for name, parts in _owned_states(sharded[-1][1]).items():
        for f in set(range(4)) - {owner[name]}:  # never written where not owned
            for a, b in zip(jax.tree.leaves(parts), jax.tree.leaves(init[name]), strict=True):
                np.testing.assert_array_equal(np.asarray(a)[:, f], np.asarray(b)[:, f])
    if case == "accordion":
        seen = {int(T.accordion_metrics(s)["modes"]["a"]) for _, s in sharded}
        assert seen == {T.LOW_COMPRESSION, T.HIGH_COMPRESSION}  # both modes' branches ran


# marked so that it runs in the fusion-emitter process beside test_sharded_equals_unsharded and
# reads that test's compiled pair (`runs`): elsewhere it compiled the pair again (2.7 s)
@pytest.mark.user_numerics
@pytest.mark.parametrize("case", ["power_sgd_ef"])
def test_slow_bytes_per_host_cut_4x(case, runs):
    """Unsharded, each of a host's 4 devices sends the whole payload over slow; sharded, the
    devices' branches (one runs per device) together send it once; over fast one more gather."""
    reports = {}
    for shard in (False, True):
        _, out, step, g = runs(case, shard)
        reports[shard] = comm.measure_collectives(step, g, out[-1][1])

    def by_group(report, size):
        return sum(r.total_bytes for r in report.records if r.group_size == size)

    per_device = by_group(reports[False], 2)
    host_unsharded = 4 * per_device  # every device runs every slow collective
    host_sharded = by_group(reports[True], 2)  # every branch once: one device runs each
    assert per_device > 0 and host_unsharded == 4 * host_sharded
    assert not [r for r in reports[True].records if r.group_size == 8]  # nothing on 8 ranks
    fast_extra = by_group(reports[True], 4) - by_group(reports[False], 4)
    assert 0 < fast_extra <= 4 * sum(np.prod(s) for s in SHAPES.values())  # the gather


def test_a_sharded_state_placed_on_another_split_is_refused(pair_mesh, grads):
    tx = CASES["top_k_ef"](True)
    with jax.set_mesh(pair_mesh):
        state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], grads)), pair_mesh, PAIR)
    with pytest.raises(ValueError, match="must be placed on the pair"):
        comm.place_state(state, pair_mesh, SLOW)
    other = comm.make_mesh([(SLOW, 4), (FAST, 2)])
    with pytest.raises(ValueError, match="another split of the devices"):
        comm.place_state(state, other, PAIR)
