"""Batches: dicts with inputs, labels and sample ids, cut into microbatches."""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

INPUT_KEYS = ("x", "inputs")
LABEL_KEYS = ("label", "labels", "targets", "y")
ID_KEY = "ids"


class Batch(NamedTuple):
    """The three parts of a batch the pipeline reads.

    Attributes:
      inputs: ``[B, ...]`` array fed to stage 0.
      labels: pytree of ``[B, ...]`` arrays passed to ``loss_fn``.
      ids: ``int[B]`` sample ids (for per-sample channels) or ``None``.
    """

    inputs: jax.Array
    labels: Any
    ids: jax.Array | None


def _pick(batch: dict, keys: tuple[str, ...], what: str) -> Any:
    found = [k for k in keys if k in batch]
    if not found:
        raise ValueError(
            f"batch must hold the {what} under one of {keys}; got keys {sorted(batch)}."
        )
    if len(found) > 1:
        raise ValueError(f"batch holds the {what} under several keys {found}; keep one.")
    return batch[found[0]]


def parse_batch(batch: Any, need_ids: bool) -> Batch:
    """Reads ``x``/``inputs``, ``label``/``labels``/``targets``/``y`` and ``ids`` from a dict.

    Raises:
      ValueError: on missing keys, or missing ``ids`` when ``need_ids`` (AQ-SGD, per-sample EF).
    """
    if isinstance(batch, Batch):
        parsed = batch
    else:
        if not isinstance(batch, dict):
            raise TypeError(f"batch must be a dict; got {type(batch).__name__}.")
        parsed = Batch(
            _pick(batch, INPUT_KEYS, "inputs"),
            _pick(batch, LABEL_KEYS, "labels"),
            batch.get(ID_KEY),
        )
    if need_ids and parsed.ids is None:
        raise ValueError(
            "a link uses per-sample buffers (AQ-SGD or per-sample error feedback): the batch "
            f"must carry the sample ids of its rows under {ID_KEY!r}."
        )
    return parsed


def check_batch(batch: Batch, num_microbatches: int, replicas: int = 1) -> int:
    """Checks leading sizes and returns the microbatch size ``B / (replicas * M)``."""
    size = jnp.shape(batch.inputs)[0] if jnp.ndim(batch.inputs) else 0
    for name, tree in (("labels", batch.labels), ("ids", batch.ids)):
        for leaf in jax.tree.leaves(tree):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != size:
                raise ValueError(
                    f"batch {name} must have the inputs' leading size {size}; got shape "
                    f"{jnp.shape(leaf)}."
                )
    if batch.ids is not None:
        if jnp.ndim(batch.ids) != 1 or not jnp.issubdtype(batch.ids.dtype, jnp.integer):
            raise ValueError(
                "batch ids must be a 1-D integer array; got "
                f"{batch.ids.dtype}{list(jnp.shape(batch.ids))}."
            )
    per = replicas * num_microbatches
    if size == 0 or size % per:
        what = f"{replicas} replicas x {num_microbatches}" if replicas > 1 else num_microbatches
        raise ValueError(f"batch size {size} must be a positive multiple of {what} microbatches.")
    return size // per


def microbatches(tree: Any, num_microbatches: int) -> Any:
    """Reshapes every leaf's leading axis ``B`` into ``(M, B // M)``."""
    return jax.tree.map(
        lambda a: a.reshape(num_microbatches, a.shape[0] // num_microbatches, *a.shape[1:]), tree
    )


def unmicrobatch(tree: Any) -> Any:
    """Inverse of :func:`microbatches`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)
