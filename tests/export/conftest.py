"""Lowering for GPU and TPU on this CPU-only machine (``jax.export``), and reading the
collectives' operand types out of the exported StableHLO module."""

import types

import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from jaxcomp import comm

PLATFORMS = ("cuda", "tpu")  # one module for both: collectives outside platform branches
KINDS = ("collective_permute", "all_gather", "all_reduce", "all_to_all", "reduce_scatter")
_MLIR_NAMES = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int8": "i8",
    "uint8": "ui8",
    "int16": "i16",
    "uint16": "ui16",
    "int32": "i32",
    "uint32": "ui32",
    "bool": "i1",
}


def element_type(dtype) -> str:
    """The StableHLO element type of a numpy/JAX dtype (``uint8`` -> ``ui8``)."""
    return _MLIR_NAMES[jnp.dtype(dtype).name]


def tensor_type(shape, dtype) -> str:
    """The StableHLO tensor type of an array (``(384,), uint8`` -> ``tensor<384xui8>``)."""
    return f"tensor<{''.join(f'{d}x' for d in shape)}{element_type(dtype)}>"


def collectives(exported: jax.export.Exported) -> list[tuple[str, str]]:
    """``(kind, operand tensor type)`` of every collective in the module, e.g.
    ``("collective_permute", "tensor<384xui8>")``, searched through every region (while
    bodies, case branches, functions)."""
    module = ir.Module.parse(exported.mlir_module(), context=mlir.make_ir_context())
    found: list[tuple[str, str]] = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    name = child.operation.name.removeprefix("stablehlo.")
                    if name in KINDS:
                        found.extend((name, str(v.type)) for v in child.operands)
                    walk(child.operation)

    walk(module.operation)
    return found


def dtypes(found, kind=None) -> set[str]:
    """The element types (``"ui8"``) among ``found`` (of one kind, if given)."""
    return {t.rpartition("x")[2].rstrip(">").removeprefix("tensor<") for k, t in found
            if kind in (None, k)}  # fmt: skip


def export(fn, *args, mesh, **kwargs) -> jax.export.Exported:
    """``jax.export`` of ``jax.jit(fn)`` for cuda and tpu at once, under ``jax.set_mesh``."""
    with jax.set_mesh(mesh):
        exported = jax.export.export(jax.jit(fn, **kwargs), platforms=PLATFORMS)(*args)
    assert exported.platforms == PLATFORMS
    return exported


def uniform(fn, *args, mesh, **kwargs) -> comm.UniformityReport:
    """``comm.check_collective_uniformity`` of the same program (raises on a violation)."""
    with jax.set_mesh(mesh):
        return comm.check_collective_uniformity(jax.jit(fn, **kwargs), *args)


@pytest.fixture(scope="session")
def lowering():
    return types.SimpleNamespace(
        platforms=PLATFORMS,
        collectives=collectives,
        dtypes=dtypes,
        element_type=element_type,
        tensor_type=tensor_type,
        export=export,
        uniform=uniform,
    )
