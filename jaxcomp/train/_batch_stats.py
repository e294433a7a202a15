"""BatchNorm running statistics in the data-parallel modes: per worker or synchronised.

The statistics are Flax's ``batch_stats`` collections, one dict per stage (``{}`` for a stage
without BatchNorm). Per worker, each stage's dict is declared
:class:`~jaxcomp.compressors.PerWorker`: placed ``[W, ...]`` sharded over the data axis, seen
as ``[1, ...]`` inside the step. Synchronised (a model built with
:meth:`~jaxcomp.models.StagedModel.with_batch_axis`), they are replicated like the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp import comm
from jaxcomp import compressors

EVAL_WITH = ("worker0", "mean")


@dataclasses.dataclass(frozen=True)
class BatchStats:
    """How a data-parallel mode lays out and evaluates BatchNorm statistics.

    Attributes:
      per_worker: each worker keeps its own statistics (else they are synchronised and
        replicated).
      eval_with: per worker, which statistics evaluation uses: ``"worker0"``'s or the
        ``"mean"`` over workers of the running means and of the running variances.
    """

    per_worker: bool
    eval_with: str = "worker0"

    def __post_init__(self):
        if self.eval_with not in EVAL_WITH:
            raise ValueError(f"eval_with must be one of {EVAL_WITH}; got {self.eval_with!r}.")

    def wrap(self, model_state: tuple[dict, ...]) -> tuple:
        """Per-stage state as the step keeps it (``PerWorker`` with a leading axis of 1)."""
        if not self.per_worker:
            return tuple(model_state)
        return tuple(
            compressors.PerWorker(jax.tree.map(lambda x: x[None], s)) if s else s
            for s in model_state
        )

    def unwrap(self, model_state: tuple) -> tuple[dict, ...]:
        """The Flax collections one worker applies (inverse of :meth:`wrap`)."""
        return tuple(
            jax.tree.map(lambda x: x[0], s.value) if isinstance(s, compressors.PerWorker) else s
            for s in model_state
        )

    def for_eval(self, model_state: tuple) -> tuple[dict, ...]:
        """The statistics evaluation uses, from the placed state (``[W, ...]`` per worker)."""

        def pick(x):
            return x.mean(0) if self.eval_with == "mean" else x[0]

        return tuple(
            jax.tree.map(pick, s.value) if isinstance(s, compressors.PerWorker) else s
            for s in model_state
        )

    def describe(self, has_batch_stats: bool) -> str:
        if not has_batch_stats:
            return "none"
        if self.per_worker:
            return f"per worker (evaluation: {self.eval_with})"
        return "synchronised over the data axis (SyncBatchNorm)"


def gradient_collective_bytes(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: str,
    params: Any,
    model_state: Any,
    batch: dict,
) -> float:
    """Bytes one worker puts into collectives to compute its *local* gradient, from the HLO.

    The gradient reduction itself is not part of it: what remains is the model's own traffic,
    e.g. a synchronised BatchNorm's all-reduces (forward: the mean and the variance of each
    layer; backward: their cotangents, as many as JAX's transpose makes). Measured rather than
    counted by hand, since XLA decides how many all-reduces the backward pass takes.

    Args:
      loss_fn: ``loss_fn(params, model_state, batch) -> (loss, (aux, model_state))``.
      mesh: the data-parallel mesh.
      axis_name: its data axis.
      params: replicated parameters (arrays or ``ShapeDtypeStruct``s).
      model_state: the placed model state (``PerWorker`` parts ``[W, ...]``).
      batch: the global batch (split over ``axis_name``).

    Returns:
      Per-device collective bytes of one gradient computation.
    """
    specs = comm.state_specs(model_state, axis_name)

    def local(params, model_state, batch):
        grad_fn = comm.local_value_and_grad(loss_fn, axis_name, has_aux=True)
        (_, (_, new_state)), grads = grad_fn(params, model_state, batch)
        leaves = jax.tree.leaves(grads) + jax.tree.leaves(new_state)
        return sum(x.sum() for x in leaves)[None]

    in_specs = (P(), specs, jax.tree.map(lambda _: P(axis_name), batch))
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(axis_name))
    with jax.set_mesh(mesh):
        text = jax.jit(fn).lower(params, model_state, batch).compile().as_text()
    return float(comm.collective_report(text).total_bytes)
