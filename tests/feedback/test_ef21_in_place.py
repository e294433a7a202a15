"""EF21 around TopK updates its donated estimate in place: no copy of it in the compiled step.

EF21's estimate ``g' = g + D(C(x - g))`` is TopK's scatter of the kept values into ``g``. The
compressed array is ``x - g``, not ``g``: the scatter needs nothing to order it after the
compression. Error feedback scatters into the array it compressed, ``c = x + e``, which it makes
with ``jaxcomp._cpu._order.computed_once`` (written once, into the donated residual). An ordering
select (``jaxcomp._cpu._order.after``) on EF21's estimate, whose output XLA:CPU could not place in
the donated buffer, made the scatter write a fresh buffer copied into the state at the end of
every step (the data-parallel bench: 8 MiB per leaf). The programs here are a training step's:
the state in, the new state out, donated; the reduced mean is also returned (the updates), as
optax does.

What is checked (copies, aliasing, temporaries) is the optimised HLO, which XLA's HLO passes
make before code generation: the steps compile at backend level 0 (``LEVEL_0``, the suite's
``fast_compiles`` options, a third of the CPU: docs/results/suite_tiers, suite13b), whose HLO
is the default compile's, text for text (test_the_hlo_checked_is_the_default_compiles).
"""

import functools
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import transforms

W = 2
SHAPE = (128, 512)  # 65536 entries per leaf, two leaves of different shapes
SHAPES = {"a": SHAPE, "b": SHAPE[::-1]}

CODECS = {
    "exact": compressors.top_k(0.01),
    "blockwise": compressors.top_k(0.1, method="blockwise"),  # blocks of 10: a scatter
    "per_sample": compressors.top_k(0.05, per_sample=True),
}
# codecs without an in-place decode: error feedback writes c - echo over c in one fused pass
DENSE_ECHO_CODECS = {"quantize": compressors.quantize(8), "power_sgd": compressors.power_sgd(2)}
#: XLA options of ``jax_disable_most_optimizations`` (the LLVM passes off, not the HLO ones)
LEVEL_0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.cache
def _step(kind, name, options="level_0"):
    """``(compiled, state, grads)`` of a donated ``compressed_mean`` step on 2 workers, with
    ``kind`` (``ef21`` or ``error_feedback``) around ``CODECS[name]``, compiled with
    ``LEVEL_0`` (``options="default"``: XLA's default options)."""
    channel = getattr(feedback, kind)({**CODECS, **DENSE_ECHO_CODECS}[name])
    mesh = comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])
    tx = transforms.compressed_mean(channel)
    zeros = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state = tx.init(zeros)
    specs = comm.state_specs(state, comm.DATA)
    state = comm.place_state(state, mesh, comm.DATA)
    rng = np.random.default_rng(0)
    grads = {
        k: jax.device_put(
            rng.standard_normal((W, *s)).astype(np.float32), NamedSharding(mesh, P(comm.DATA))
        )
        for k, s in SHAPES.items()
    }

    def body(state, grads):
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        return state, updates

    out = (specs, P())
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), out, is_leaf=lambda x: isinstance(x, P)
    )
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(comm.DATA)), out_specs=out),
        donate_argnums=(0,),
        out_shardings=shardings,
    )
    compiled = fn.lower(state, grads).compile(LEVEL_0 if options == "level_0" else None)
    return compiled, state, grads


def _state_copies(compiled):
    """The ``copy`` instructions of the entry computation that write a per-worker state leaf
    (``f32[1, ...]`` of a leaf's shape): an estimate or a residual not updated in place."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") :]
    shapes = {f"f32[1,{a},{b}]" for a, b in SHAPES.values()}
    return [
        line.strip()[:120]
        for line in entry.splitlines()
        if re.search(r"= f32\[1,\d+,\d+\]\{[\d,]+\} copy\(", line)
        and line.split("=")[1].split("{")[0].strip() in shapes
    ]


#: where the HLO's metadata and stack frames point in the source (the tests' lines included)
_SOURCE = r", metadata=\{[^}]*\}|\bline=\d+ end_line=\d+ column=\d+( end_column=\d+)?"


@pytest.mark.slow
def test_the_hlo_checked_is_the_default_compiles():
    # PowerSGD's step: its c in the donated buffer and its temporaries are fusion decisions
    level_0 = _step("error_feedback", "power_sgd")[0]  # the cached one the tests below check
    default = _step("error_feedback", "power_sgd", "default")[0]
    texts = [re.sub(_SOURCE, "", c.as_text()) for c in (level_0, default)]
    assert texts[0] == texts[1]
    analyses = (c.memory_analysis() for c in (level_0, default))
    assert len({(a.temp_size_in_bytes, a.alias_size_in_bytes) for a in analyses}) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CODECS))
def test_ef21_estimate_updated_in_place(name):
    compiled, _, _ = _step("ef21", name)
    assert _state_copies(compiled) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CODECS))
def test_error_feedback_residual_updated_in_place(name):
    # EF scatters into the array it compressed (c = x + e), made by _order.computed_once:
    # ordered with _order.after instead, exact TopK per sample copied the first leaf's
    # residual here (8bcdf7e)
    compiled, _, _ = _step("error_feedback", name)
    assert _state_copies(compiled) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DENSE_ECHO_CODECS))
def test_error_feedback_writes_c_and_the_residual_into_the_donated_buffer(name):
    # c = x + e made by _order.computed_once in the residual's buffer, c - echo over it after
    # the mean: fused into its readers, PowerSGD's c took a temporary of a leaf's size (8 MiB
    # per leaf of the bench); unordered after the mean, quantize's residual was copied at entry
    compiled, _, _ = _step("error_feedback", name)
    assert _state_copies(compiled) == []
    leaf_bytes = 4 * SHAPE[0] * SHAPE[1]
    assert compiled.memory_analysis().temp_size_in_bytes < leaf_bytes


@pytest.mark.slow
def test_ef21_step_in_place_keeps_the_formula():
    # the donated step (no ordering select) against g' = g + D(C(x - g)) and G' = mean of g'
    codec = CODECS["blockwise"]
    compiled, state, grads = _step("ef21", "blockwise")
    state = jax.tree.map(lambda a: a.copy(), state)  # the cached one is donated below
    x = {k: np.asarray(v) for k, v in grads.items()}
    roundtrip = jax.jit(lambda d: codec.decompress(codec.compress(d, codec.init(d))[0], d))
    for _ in range(2):  # the second step starts from a non-zero estimate
        g = {
            k: np.asarray(state.leaves[k].memory.estimate.value).reshape(W, *s)
            for k, s in SHAPES.items()
        }
        state, updates = compiled(state, grads)
        for k in SHAPES:
            want = []
            for w in range(W):
                want.append(g[k][w] + np.asarray(roundtrip(x[k][w] - g[k][w])))
            got = np.asarray(state.leaves[k].memory.estimate.value).reshape(W, *SHAPES[k])
            np.testing.assert_array_equal(got, np.stack(want))
            np.testing.assert_allclose(
                np.asarray(updates[k]), np.mean(want, axis=0), rtol=1e-6, atol=1e-6
            )
