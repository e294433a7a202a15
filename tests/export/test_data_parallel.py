"""The data-parallel step for each reduction path, Accordion included, lowers for cuda and tpu
with the compressed payloads on its collectives and every branch uniform over the data axis."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import feedback as F
from jaxcomp import parallel
from jaxcomp import transforms as T

W = 4
DENSE_W = "tensor<64x32xf32>"  # the weight's gradient, uncompressed


def _tx(make):
    return optax.chain(make(), optax.sgd(0.1))


# name -> (transform, {collective kind: element types that must travel there})
CASES = {
    # (index dtypes: uint16 when the array has < 2**16 entries)
    "dense": (lambda: T.compressed_mean(C.identity(), path="dense"), {"all_reduce": {"f32"}}),
    "psum_rand_k": (lambda: T.compressed_mean(C.rand_k(0.1), path="psum"), {"all_reduce": {"f32"}}),
    "psum_bf16": (
        lambda: T.compressed_mean(C.cast("bfloat16"), path="psum"),
        {"all_reduce": {"bf16"}},
    ),
    "all_gather_top_k_ef": (
        lambda: T.compressed_mean(F.error_feedback(C.top_k(0.1))),
        {"all_gather": {"f32", "ui16"}},
    ),
    "all_gather_quantize4": (lambda: T.compressed_mean(C.quantize(4)), {"all_gather": {"ui8"}}),
    "two_phase_quantize8": (
        lambda: T.compressed_mean(C.quantize(8), path="two_phase"),
        {"all_to_all": {"ui8"}, "all_gather": {"ui8"}},
    ),
    "codec_power_sgd_ef": (
        lambda: T.compressed_mean(F.error_feedback(C.power_sgd(2))),
        {"all_reduce": {"f32"}},
    ),
    "ef21_top_k": (
        lambda: T.compressed_mean(F.ef21(C.top_k(0.1))),
        {"all_gather": {"f32", "ui16"}},
    ),
    "accordion_power_sgd": (
        lambda: T.accordion(C.power_sgd(2), C.power_sgd(1), interval_steps=2),
        {"all_reduce": {"f32"}},
    ),
    "accordion_top_k_ef": (
        lambda: T.accordion(
            F.error_feedback(C.top_k(0.25)), F.error_feedback(C.top_k(0.05)), interval_steps=2
        ),
        {"all_gather": {"f32", "ui16"}},
    ),
}


def _loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"]) + p["b"] - b["y"]) ** 2)


@pytest.fixture(scope="module")
def setup():
    mesh = comm.make_mesh([(comm.DATA, W)], devices=jax.devices()[:W])
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32), "b": jnp.zeros((32,))}
    batch = {"x": rng.normal(size=(8, 64)).astype(np.float32), "y": np.zeros((8, 32), np.float32)}
    return mesh, params, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_data_parallel_step_exports_with_compressed_collectives(name, setup, lowering):
    mesh, params, batch = setup
    make, expected = CASES[name]
    dp = parallel.data_parallel(_loss, _tx(make), mesh, donate=False)
    state = dp.init(params)
    with jax.set_mesh(mesh):
        found = lowering.collectives(dp.step.export(state, batch, lowering.platforms))
        report = comm.check_collective_uniformity(dp.step.trace(state, batch))
    for kind, types in expected.items():
        assert types <= lowering.dtypes(found, kind), (kind, found)
    dense = [k for k, t in found if t == DENSE_W]
    assert dense == (["all_reduce"] if name == "dense" else []), found
    if name.startswith("accordion"):
        assert report.branches > 0  # its mode switch holds collectives: proven uniform
