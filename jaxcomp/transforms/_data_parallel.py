"""A data-parallel train step: local gradients, a compressing optax chain, replicated params."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.comm import _placement


class TrainState(NamedTuple):
    """Replicated parameters and the optimizer state (per-worker leaves sharded over data).

    Attributes:
      step: ``int32[]``, updates applied.
      params: the parameters, replicated.
      opt_state: the optimizer state as :func:`jaxcomp.comm.place_state` lays it out: leaves
        owned by one worker (error-feedback residuals, Accordion accumulators, marked
        :class:`~jaxcomp.compressors.PerWorker`) are ``[W, ...]`` sharded over the data axis,
        the rest replicated.
    """

    step: jax.Array
    params: Any
    opt_state: Any


class DataParallel(NamedTuple):
    """What :func:`data_parallel` returns.

    Attributes:
      init: ``init(params) -> TrainState``, placed on the mesh.
      step: ``step(state, batch) -> (state, metrics)``, jitted; ``batch`` leaves are split
        over the data axis along their first dimension; ``metrics["loss"]`` is the mean loss.
      shard_batch: places a host batch on the mesh (``step`` calls it too).
      state_sharding: ``state_sharding(params) -> TrainState`` of ``NamedSharding``s, e.g.
        for an orbax restore target.
      mesh: the mesh.
      axis_name: the data axis.
    """

    init: Callable[[Any], TrainState]
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]
    shard_batch: Callable[[Any], Any]
    state_sharding: Callable[[Any], TrainState]
    mesh: jax.sharding.Mesh
    axis_name: str


def data_parallel(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str = _mesh.DATA,
    has_aux: bool = False,
    donate: bool = True,
) -> DataParallel:
    """A jitted data-parallel train step whose gradient averaging is done by ``tx``.

    Inside ``shard_map`` each worker takes the gradient of ``loss_fn(params, batch_shard)``
    with :func:`jaxcomp.comm.local_value_and_grad` (no hidden all-reduce), then
    ``tx.update`` averages and transforms it: ``tx`` must start with a reducing transform
    such as :func:`compressed_mean` or :func:`accordion` (the step raises otherwise).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); the
        mean over this worker's shard of the batch.
      tx: the optimizer, e.g. ``optax.chain(accordion(...), optax.sgd(0.1, momentum=0.9))``.
      mesh: a mesh with an axis ``axis_name``.
      axis_name: the data axis.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``metrics["aux"]`` is ``aux`` averaged
        over workers.
      donate: donate the old state's buffers to the new one.

    Returns:
      A :class:`DataParallel` with ``init``, ``step`` and ``shard_batch``.

    Example:
      >>> # mesh = jaxcomp.comm.make_mesh([("data", 8)])
      >>> # dp = data_parallel(loss_fn, optax.chain(compressed_mean(top_k(0.01)), optax.sgd(0.1)),
      >>> #                    mesh)
      >>> # state = dp.init(params); state, metrics = dp.step(state, batch)
    """
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}.")
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(axis_name))

    def init_opt(params):
        # under the mesh: protocols sized by the number of workers (two-phase) read it there
        with jax.set_mesh(mesh):
            return jax.jit(tx.init)(params)

    def init(params):
        # copy first: a replicated device_put aliases the caller's buffer, which step donates
        params = jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), params), replicated)
        step0 = jax.device_put(jnp.zeros((), jnp.int32), replicated)
        opt_state = _placement.place_state(init_opt(params), mesh, axis_name)
        return TrainState(step0, params, opt_state)

    def body(state, batch):
        grad_fn = _local.local_value_and_grad(loss_fn, axis_name, has_aux=has_aux)
        value, grads = grad_fn(state.params, batch)
        loss, aux = value if has_aux else (value, None)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        bad = [
            jax.tree_util.keystr(path)
            for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
            if axis_name in _local.varying_axes(u)
        ]
        if bad:
            raise ValueError(
                f"tx returned updates that differ per worker for {bad[:3]}...: it must average "
                f"gradients over {axis_name!r} (start the chain with transforms.compressed_mean "
                "or transforms.accordion)."
            )
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": lax.pmean(loss, axis_name)}
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda a: lax.pmean(a, axis_name), aux)
        return TrainState(state.step + 1, params, opt_state), metrics

    def _step(layout, state, batch):
        treedef, flat_specs = layout
        specs = jax.tree.unflatten(treedef, flat_specs)
        batch_specs = jax.tree.map(lambda _: P(axis_name), batch)
        sharded = jax.shard_map(
            body, mesh=mesh, in_specs=(specs, batch_specs), out_specs=(specs, P())
        )
        return sharded(state, batch)

    jitted = jax.jit(_step, static_argnums=(0,), donate_argnums=(1,) if donate else ())

    def shard_batch(batch):
        return jax.device_put(batch, split)

    def spec_of(leaf):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
            raise ValueError(
                "the train state must live on the mesh: create it with init(params), or restore "
                "it with the shardings of state_sharding(params)."
            )
        return sharding.spec

    def layout_of(state):
        flat, treedef = jax.tree.flatten(state)
        return treedef, tuple(spec_of(leaf) for leaf in flat)

    def step(state, batch):
        return jitted(layout_of(state), state, shard_batch(batch))

    # so that jax.jit-style tools (comm.measure_collectives) can compile it without running
    step.lower = lambda state, batch: jitted.lower(layout_of(state), state, shard_batch(batch))

    def state_sharding(params):
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(tx.init, params)
        placed = _placement.place_state(abstract, mesh, axis_name)
        opt = jax.tree.map(lambda s: s.sharding, placed)
        return TrainState(replicated, jax.tree.map(lambda _: replicated, params), opt)

    return DataParallel(init, step, shard_batch, state_sharding, mesh, axis_name)
