"""compressed_mean over a (slow, fast) axis pair on a 2 x 4 mesh: dense over the fast axis,
compressed over the slow one; the mean equals the flat mean; the program's collectives say so.
Across 2 processes (the slow axis), through the trainer: tests/train/test_two_processes.py."""

import jax
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import transforms as T

pytestmark = pytest.mark.usefixtures("fast_compiles")

SLOW, FAST = "slow", "fast"
SHAPE = (64, 32)
FAST_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]  # devices of one host
SLOW_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]  # one device per host


@pytest.fixture(scope="module")
def grads(pair_grads):
    return pair_grads(SHAPE)


def _step(tx, mesh, state):
    specs = comm.state_specs(state, SLOW)
    both = P((SLOW, FAST))

    def body(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        mean, s = tx.update(g, s)
        return mean, s

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(both, specs), out_specs=(P(), specs)))


def _setup(channel, mesh, grads):
    tx = T.compressed_mean(channel, (SLOW, FAST))
    with jax.set_mesh(mesh):
        state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], grads)), mesh, SLOW)
    g = jax.device_put(grads, NamedSharding(mesh, P((SLOW, FAST))))
    return _step(tx, mesh, state), g, state


def test_identity_over_the_pair_is_the_mean_of_all_eight(pair_mesh, grads):
    step, g, state = _setup(C.identity(), pair_mesh, grads)
    mean, new = step(g, state)
    for k in grads:
        np.testing.assert_allclose(np.asarray(mean[k]), grads[k].mean(0), rtol=1e-5, atol=1e-6)
    assert float(new.fast_bytes_sent) == 4 * (64 * 32 + 32)


def test_power_sgd_with_ef_over_the_pair_is_power_sgd_of_the_host_means(pair_mesh, grads):
    """== the same transform over the slow axis alone, fed each host's dense mean."""
    channel = F.error_feedback(C.power_sgd(2))
    step, g, state = _setup(channel, pair_mesh, grads)
    host = {k: v.reshape(2, 4, *v.shape[1:]).mean(1) for k, v in grads.items()}
    flat_mesh = comm.make_mesh([(SLOW, 2)], devices=jax.devices()[:2])
    tx = T.compressed_mean(channel, SLOW)
    with jax.set_mesh(flat_mesh):
        ref_state = comm.place_state(tx.init(jax.tree.map(lambda x: x[0], host)), flat_mesh, SLOW)
    specs = comm.state_specs(ref_state, SLOW)
    ref = jax.jit(
        jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
                      mesh=flat_mesh, in_specs=(P(SLOW), specs), out_specs=(P(), specs))
    )  # fmt: skip
    h = jax.device_put(host, NamedSharding(flat_mesh, P(SLOW)))
    for _ in range(2):  # the second step uses the residuals and warm-started Q
        mean, state = step(g, state)
        ref_mean, ref_state = ref(h, ref_state)
        for k in grads:
            np.testing.assert_allclose(np.asarray(mean[k]), np.asarray(ref_mean[k]), rtol=2e-5,
                                       atol=1e-6)  # fmt: skip
        assert float(state.bytes_sent) == float(ref_state.bytes_sent)
    assert float(state.bytes_sent) < 4 * 64 * 32 / 4  # compressed on the slow links


def _collectives(exported):
    """(kind, operand type, replica groups / pairs) of every collective of the module."""
    module = ir.Module.parse(exported.mlir_module(), context=mlir.make_ir_context())
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.name.removeprefix("stablehlo.")
                    attrs = child.operation.attributes
                    if name in ("all_reduce", "all_gather", "all_to_all", "collective_permute"):
                        key = "source_target_pairs" if "source_target_pairs" in attrs else (
                            "replica_groups")  # fmt: skip
                        groups = np.asarray(
                            ir.DenseIntElementsAttr(attrs[key]), dtype=np.int64
                        ).tolist()
                        found.extend((name, str(v.type), groups) for v in child.operands)
                    walk(child.operation)

    walk(module.operation)
    return found


@pytest.mark.parametrize(
    "channel, payload",
    [
        (F.error_feedback(C.quantize(4)), "ui8"),
        (F.error_feedback(C.top_k(0.1)), "ui16"),
        (F.error_feedback(C.power_sgd(2)), "f32"),
    ],
    ids=["quantize4_ef", "top_k_ef", "power_sgd_ef"],
)
def test_hlo_dense_on_fast_compressed_on_slow(channel, payload, pair_mesh, grads):
    step, g, state = _setup(channel, pair_mesh, grads)
    with jax.set_mesh(pair_mesh):
        exported = jax.export.export(step, platforms=["cuda", "tpu"])(g, state)
    found = _collectives(exported)
    dense = "tensor<64x32xf32>"
    fast = [(k, t) for k, t, groups in found if groups == FAST_GROUPS]
    slow = [(k, t) for k, t, groups in found if groups == SLOW_GROUPS]
    assert len(fast) + len(slow) == len(found), found  # no collective over the whole mesh
    assert ("all_reduce", dense) in fast and ("all_reduce", "tensor<32xf32>") in fast
    assert slow and all(t != dense for _, t in slow), slow  # the slow links see no dense w
    assert any(t.endswith(f"x{payload}>") for _, t in slow), slow
    # the compressed reduction's bytes over the slow axis are the transform's own count
    slow_bytes = sum(
        np.prod([int(d) for d in t[7:-1].split("x")[:-1]] or [1])
        * {"f32": 4, "ui8": 1, "ui16": 2}[t[7:-1].split("x")[-1]]
        for _, t in slow
    )
    assert slow_bytes > 0 and slow_bytes < 64 * 32 * 4 / 2


@pytest.mark.parametrize(
    "axis_name", [("slow", "slow"), ("a", "b", "c"), ("a", 1), ["slow"]], ids=str
)
def test_bad_axis_pairs_are_named(axis_name):
    with pytest.raises(ValueError, match="pair of distinct names"):
        T.compressed_mean(C.quantize(4), axis_name)
