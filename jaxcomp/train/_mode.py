"""The contract between the trainer and a training mode, and what modes share.

A *mode* (``dense``, ``pipeline``, ``data_parallel``, ``ab``) turns a model, an optimizer and a
mesh into jitted pure functions over one state pytree::

  state = mode.init(key)                                    # sharded on the mode's mesh
  state, metrics = mode.train_step(state, batch, key, step) # metrics: loss, accuracy, finite...
  sums = mode.eval_step(state, batch, compressed)           # loss_sum, correct_sum, count

The trainer owns everything else (data, checkpoints, metrics, progress), so every mode is
checkpointed, resumed and reported the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _cpu
from jaxcomp import _finite
from jaxcomp.models import _staged


class Mode(NamedTuple):
    """A training mode, built by ``build_<mode>(config, model, mesh, num_train_samples)``.

    Attributes:
      name: ``"dense"``, ``"pipeline"``, ...
      mesh: the device mesh the state and batches live on.
      init: ``init(key) -> state``.
      train_step: ``train_step(state, batch, key_data, step) -> (state, metrics)``; ``step``
        is the host's step count (a Python int, e.g. to end a warm-up); a non-finite loss,
        gradient or resulting state leaves ``state`` unchanged and reports ``finite == 0``
        (:func:`commit_if_finite`).
      eval_step: ``eval_step(state, batch, compressed: bool) -> {"loss_sum", "correct_sum",
        "count"}`` over the batch rows whose ``mask`` is 1.
      batch_sharding: how to place batch arrays (sharded along their leading axis).
      wire_bytes: bytes one device sends per training step, read from the compiled HLO.
      dense_bytes: bytes the same step would send uncompressed.
      description: one line for the log.
      has_compressed_eval: whether evaluation with compression on differs from off.
      extra: mode-specific facts for the summary table.
      sample_shards: the data replicas that keep per-sample buffers (AQ-SGD caches), for the
        training loader's fixed per-replica shards (``data.Loader(shards=...)``); 1 when no
        buffer is kept per sample and replica (the split shuffled over the whole batch).
    """

    name: str
    mesh: jax.sharding.Mesh
    init: Callable[[jax.Array], Any]
    train_step: Callable[[Any, dict, jax.Array, int], tuple[Any, dict]]
    eval_step: Callable[[Any, dict, bool], dict]
    batch_sharding: jax.sharding.NamedSharding
    wire_bytes: float
    dense_bytes: float
    description: str
    has_compressed_eval: bool = False
    extra: dict | None = None
    sample_shards: int = 1


def jit_init(fn: Callable, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fn, **jit_kwargs)`` for a state init (run once, random initializers); on the CPU
    the same bits compiled several times faster (:func:`jaxcomp._cpu.jit_init`: the threefry
    key part at a low backend level, where integers are exact, the float math as XLA's default
    compiles it).

    Float math is never compiled at another backend level here: float bits follow the level
    (compiling the whole init at level 1 was tried and withdrawn; ``docs/performance.md``).
    ``tests/_cpu/test_init_program.py`` pins the bits for every model.

    Example:
      >>> init = jit_init(model.init)  # doctest: +SKIP
      >>> variables = init(jax.random.key(0))  # doctest: +SKIP
    """
    return _cpu.jit_init(fn, **jit_kwargs)


def all_finite(*trees: Any, replicated: bool = False) -> jax.Array:
    """True iff every leaf of every tree is finite (a scalar bool).

    ``replicated``: every leaf is replicated, so the leaves are tested in a few concatenated
    groups instead of one by one (:func:`jaxcomp._finite.all_finite_global`).
    """
    return _finite.all_finite_global(*trees, replicated=replicated)


def keep_if_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite`` else ``old``, leaf by leaf: a bad step changes nothing."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def commit_if_finite(
    new: Any, old: Any, *computed: Any, replicated: bool = False
) -> tuple[Any, jax.Array]:
    """The state a step commits: ``new`` if it and ``computed`` are finite, else ``old``.

    Every mode's step ends with it, so a step whose loss or gradients (``computed``) or whose
    *resulting* parameters, optimizer, link or transform state hold NaN or Inf (e.g. an
    overflowing update at a huge learning rate, from finite gradients) changes nothing.

    Args:
      new: the state after the step.
      old: the state before it (same structure).
      *computed: values the step computed on the way (loss, gradients).
      replicated: every leaf of ``new`` and ``computed`` is replicated over the mesh (the
        dense mode): the test compiles to a few kernels instead of about three per leaf.

    Returns:
      ``(state, finite)``: the committed state and the scalar bool.

    Example:
      >>> old = {"w": jnp.ones(2)}
      >>> state, finite = commit_if_finite({"w": jnp.array([1.0, jnp.inf])}, old, jnp.array(0.5))
      >>> bool(finite), state["w"].tolist()
      (False, [1.0, 1.0])
    """
    finite = all_finite(new, *computed, replicated=replicated)
    return keep_if_finite(finite, new, old), finite


def eval_sums(model: _staged.StagedModel, logits: jax.Array, batch: dict) -> dict:
    """Masked sums of per-example loss and accuracy (per-token means for a language model)."""
    labels = batch["label"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    if ce.ndim > 1:
        ce = ce.reshape(ce.shape[0], -1).mean(-1)
        correct = correct.reshape(correct.shape[0], -1).mean(-1)
    mask = batch.get("mask")
    mask = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
    return {
        "loss_sum": (ce * mask).sum(),
        "correct_sum": (correct * mask).sum(),
        "count": mask.sum(),
    }


def param_count(tree: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


def split_variables(variables: tuple[dict, ...]) -> tuple[tuple, tuple]:
    """``(params per stage, other collections per stage)`` from Flax variables."""
    params = tuple(v["params"] for v in variables)
    rest = tuple({k: c for k, c in v.items() if k != "params"} for v in variables)
    return params, rest


def join_variables(params: tuple, rest: tuple) -> tuple[dict, ...]:
    return tuple({"params": p, **r} for p, r in zip(params, rest))


def parameter_name(path: str) -> str:
    """A parameter's name in the run's metrics (and TensorBoard tags): its ``/``-joined path in
    the per-stage tuple of parameters without the stage index, as ``exclude`` and the model's
    segments spell it (``"1/fc2/Dense_0/kernel"`` -> ``"fc2/Dense_0/kernel"``). A staged
    model's segment names are distinct, so the name is unique.

    Raises:
      ValueError: if ``path`` does not start with a stage index.
    """
    stage, sep, rest = path.partition("/")
    if not (stage.isdigit() and sep):
        raise ValueError(f"expected a parameter path that starts with a stage index; got {path!r}.")
    return rest


def compiled_text_bytes(compiled) -> float:
    """Per-device collective bytes of one call of an AOT-compiled function, from its HLO."""
    from jaxcomp import comm

    return float(comm.collective_report(compiled.as_text()).total_bytes)
