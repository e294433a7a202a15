"""A data-parallel train step: local gradients, a compressing optax chain, replicated params.

A model with mutable state (BatchNorm running statistics) passes ``has_state=True``: its state
travels in :attr:`TrainState.model_state`, per worker where declared
:class:`~jaxcomp.compressors.PerWorker` (each worker's own statistics), replicated otherwise
(statistics the model synchronises itself, e.g. a BatchNorm with ``axis_name``).

A Flax NNX model goes in as the module itself, ``init(model)``, with ``loss_fn(model, batch)``:
the state holds its ``nnx.Param`` variables as ``params`` (nested dicts keyed by attribute
name) and the rest of the module as ``model_state`` (its graph, static, and its other state), and
:meth:`TrainState.module` merges them back.
"""

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

from jaxcomp import _driver
from jaxcomp import _nnx
from jaxcomp._driver import TrainState
from jaxcomp.comm import _local
from jaxcomp.comm import _mesh
from jaxcomp.comm import _placement
from jaxcomp.transforms import _compressed_mean


class DataParallel(NamedTuple):
    """What :func:`data_parallel` returns.

    Attributes:
      init: ``init(params, model_state=()) -> TrainState``, placed on the mesh; ``params``
        may be a Flax ``nnx.Module`` instead (then ``loss_fn(model, batch)``).
      step: ``step(state, batch) -> (state, metrics)``, jitted; ``batch`` leaves are split
        over the data axis along their first dimension (a size the workers do not divide is
        a ``ValueError`` naming both); ``metrics["loss"]`` is the mean loss,
        ``metrics["bytes_sent"]`` (``float32[W]``) the bytes each worker put into the
        gradient average's collectives this step (the reducing transform's ``bytes_sent``;
        a hierarchical mesh adds ``fast_bytes_sent``, its dense average over the fast axis)
        and ``metrics["dense_bytes"]`` (``float32[W]``) the bytes of the dense gradient,
        what an uncompressed average would send.
      shard_batch: places a host batch on the mesh (``step`` calls it too).
      state_sharding: ``state_sharding(params, model_state=()) -> TrainState`` of
        ``NamedSharding`` values, e.g. for an orbax restore target.
      mesh: the mesh.
      axis_name: the data axis, or the ``(slow, fast)`` pair of a hierarchical mesh.
    """

    init: Callable[[Any], TrainState]
    step: Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]
    shard_batch: Callable[[Any], Any]
    state_sharding: Callable[..., TrainState]
    mesh: jax.sharding.Mesh
    axis_name: str | tuple[str, str]


def data_parallel(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    *,
    axis_name: str | tuple[str, str] = _mesh.DATA,
    has_aux: bool = False,
    has_state: bool = False,
    donate: bool = True,
    check_finite: bool = False,
) -> DataParallel:
    """A jitted data-parallel train step whose gradient averaging is done by ``tx``.

    Inside ``shard_map`` each worker takes the gradient of ``loss_fn(params, batch_shard)``
    with :func:`jaxcomp.comm.local_value_and_grad` (no hidden all-reduce), then
    ``tx.update`` averages and transforms it: ``tx`` must start with a reducing transform
    such as :func:`compressed_mean` or :func:`accordion` (the step raises otherwise).

    A Flax NNX model goes in whole: ``init(model)`` with an ``nnx.Module``, ``loss_fn(model,
    batch)``. The module is split into its ``nnx.Param`` variables (nested dicts keyed by
    attribute name, as a Linen model's: what is differentiated, averaged and updated) and the
    rest; inside the step the module is merged
    from the parameters as each worker differentiates them (locally: ``nnx.value_and_grad``
    of the replicated module would insert a dense all-reduce), and :meth:`TrainState.module`
    merges it back. Its other state (BatchNorm statistics) is kept as ``loss_fn`` leaves it;
    it must come out the same on every worker (``nnx.BatchNorm(..., axis_name=...)``).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``); the
        mean over this worker's shard of the batch. ``loss_fn(model, batch)`` for an NNX
        model.
      tx: the optimizer, e.g. ``optax.chain(accordion(...), optax.sgd(0.1, momentum=0.9))``.
      mesh: a mesh with an axis ``axis_name`` (both axes of a pair).
      axis_name: the data axis, or a ``(slow, fast)`` pair of axes of a hierarchical mesh
        (:func:`jaxcomp.comm.make_mesh` ``[(slow, hosts), (fast, devices per host)]``): the
        batch is split over both, the workers are the devices of both, per-worker optimizer
        state belongs to a slow worker (``[slow size, ...]`` sharded over ``slow``), and
        ``tx`` must average over the pair (``compressed_mean(codec, (slow, fast))``: dense
        over ``fast``, compressed over ``slow``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``metrics["aux"]`` is ``aux`` averaged
        over workers.
      has_state: the model has mutable state (BatchNorm statistics): ``loss_fn(params,
        model_state, batch)`` returns ``(loss, model_state)`` (``(loss, (aux, model_state))``
        with ``has_aux``), and the new state is kept in ``TrainState.model_state``. Parts
        declared :class:`~jaxcomp.compressors.PerWorker` (leading axis 1 inside the step) are
        each worker's own; the rest must come out the same on every worker (the step raises
        otherwise). Not with an axis pair (a per-worker model state would belong to a device,
        the optimizer's to a slow worker).
      donate: donate the old state's buffers to the new one.
      check_finite: add ``metrics["finite"]``, ``int32[W]``: per worker, 1 if its loss and
        its new parameters, optimizer state and model state are finite (no collective is
        added: the host combines the flags; with ``donate=False`` the previous state can be
        kept when one is 0).

    Returns:
      A :class:`DataParallel` with ``init``, ``step`` and ``shard_batch``. The step's program
      is compiled once per state layout, on its first call (or ahead of time through
      ``step.lower(state, batch).compile()``).

    Example:
      >>> # mesh = jaxcomp.comm.make_mesh([("data", 8)])
      >>> # dp = data_parallel(loss_fn, optax.chain(compressed_mean(top_k(0.01)), optax.sgd(0.1)),
      >>> #                    mesh)
      >>> # state = dp.init(params); state, metrics = dp.step(state, batch)
    """
    axes = _worker_axes(axis_name, mesh)
    slow = axes[0]  # the axis per-worker optimizer state is sharded over
    # per-worker optimizer state over slow, per-device parts (a mean sharded over fast) over both
    placed_over = axes if len(axes) == 2 else slow
    if has_state and len(axes) == 2:
        raise ValueError(
            f"data_parallel(has_state=True) takes one data axis; got the pair {axis_name!r} "
            "(a per-worker model state over a (slow, fast) pair is not supported)."
        )
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(axes if len(axes) == 2 else slow))

    def init_opt(params):
        # under the mesh: protocols sized by the number of workers (two-phase) read it there
        with jax.set_mesh(mesh):
            return jax.jit(tx.init)(params)

    def init(params, model_state=()):
        params, model_state = _driver.split_model(params, model_state)
        step0, params = _driver.replicate((jnp.zeros((), jnp.int32), params), mesh)
        opt_state = _placement.place_state(init_opt(params), mesh, placed_over)
        return TrainState(step0, params, opt_state, _place_model_state(model_state))

    def _place_model_state(model_state):
        nnx = isinstance(model_state, _nnx.Rest)
        if jax.tree.leaves(model_state) and not (has_state or nnx):
            raise ValueError("a model_state was given to a data_parallel built without has_state.")
        return _placement.place_state(model_state, mesh, slow)

    model_loss = _driver.stateful_loss(loss_fn, has_aux, has_state)

    def body(state, batch):
        grad_fn = _local.local_value_and_grad(model_loss, axes, has_aux=True)
        (loss, (aux, model_state)), grads = grad_fn(state.params, state.model_state, batch)
        _check_model_state(model_state, state.model_state)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        bad = [
            jax.tree_util.keystr(path)
            for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]
            if set(axes) & _local.varying_axes(u)
        ]
        if bad:
            raise ValueError(
                f"tx returned updates that differ per worker for {bad[:3]}...: it must average "
                f"gradients over {axis_name!r} (start the chain with transforms.compressed_mean "
                "or transforms.accordion)."
            )
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": _mean(loss, axes), **_bytes_of(opt_state, grads, len(axes) == 2)}
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda a: _mean(a, axes), aux)
        if check_finite:  # this worker's own loss and state: no collective
            metrics["finite"] = _driver.all_finite((params, opt_state, model_state), loss)[None]
        return TrainState(state.step + 1, params, opt_state, model_state), metrics

    def _check_model_state(new, old):
        if jax.tree.structure(new) != jax.tree.structure(old):
            raise ValueError(
                "loss_fn returned a model_state of another structure than it was given: "
                f"{jax.tree.structure(new)} vs {jax.tree.structure(old)}."
            )
        specs = _placement.state_specs(old, slow)  # one axis: has_state takes no pair
        flags = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        bad = [
            jax.tree_util.keystr(path)
            for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(new)[0], flags)
            if spec == P() and slow in _local.varying_axes(x)
        ]
        if bad and isinstance(new, _nnx.Rest):
            raise ValueError(
                f"the NNX module's state {bad[:3]} differs per worker after loss_fn: "
                f"synchronise it over {axis_name!r} (e.g. nnx.BatchNorm(..., axis_name=...))."
            )
        if bad:
            raise ValueError(
                f"model_state leaves {bad[:3]} differ per worker but are not declared PerWorker: "
                f"declare them compressors.PerWorker or synchronise them over {axis_name!r}."
            )

    def specs(state, batch):
        state_specs = _driver.layout_of(state, mesh)
        metrics = {"loss": P(), **({"aux": P()} if has_aux else {})}
        for name in _byte_names(state.opt_state, len(axes) == 2):
            metrics[name] = split.spec
        if check_finite:
            metrics["finite"] = split.spec
        return (state_specs, jax.tree.map(lambda _: split.spec, batch)), (state_specs, metrics)

    program = _driver.Program(body, mesh, specs, donate=donate)

    def shard_batch(batch):
        _driver.check_divisible(batch, mesh, axes)
        return jax.device_put(batch, split)

    def step(state, batch):
        return program(state, shard_batch(batch))

    def jitted(state, batch):
        batch = shard_batch(batch)
        return program.jitted(state, batch), (state, batch)

    def lower(state, batch):
        fn, args = jitted(state, batch)
        return fn.lower(*args)

    def trace(state, batch):
        fn, args = jitted(state, batch)
        return fn.trace(*args)

    def export(state, batch, platforms):
        fn, args = jitted(state, batch)
        return jax.export.export(fn, platforms=platforms)(*args)

    # so that jax.jit-style tools (comm.measure_collectives) can compile it without running,
    # comm.check_collective_uniformity trace it, and tests export it for other platforms
    step.lower, step.trace, step.export = lower, trace, export

    def state_sharding(params, model_state=()):
        params, model_state = _driver.split_model(params, model_state)
        with jax.set_mesh(mesh):
            abstract = jax.eval_shape(tx.init, params)
        shardings = [
            jax.tree.map(lambda s: s.sharding, _placement.place_state(a, mesh, over))
            for a, over in (
                (abstract, placed_over),
                (jax.eval_shape(lambda m: m, model_state), slow),
            )
        ]
        return TrainState(replicated, jax.tree.map(lambda _: replicated, params), *shardings)

    return DataParallel(init, step, shard_batch, state_sharding, mesh, axis_name)


def _mean(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The mean over the workers: over a ``(slow, fast)`` pair inside each host first, then the
    hosts' means between them (a 2-rank ring on the slow links, where one all-reduce over every
    device would run a ring of all of them through the slow links)."""
    for axis in reversed(axes):
        x = lax.pmean(x, axis)
    return x


def _reducer(opt_state: Any) -> Any:
    """The reducing transform's state in ``opt_state``: the first with a ``bytes_sent`` field
    (``compressed_mean``, ``accordion``) or an ``accordion_batch_size`` state; ``None``."""
    from jaxcomp import transforms

    def is_state(x):
        return isinstance(x, transforms.AccordionBatchState) or hasattr(x, "bytes_sent")

    return next((x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)), None)


def _byte_names(opt_state: Any, pair: bool) -> tuple[str, ...]:
    """The byte metrics the step reports for this optimizer state (abstract or not)."""
    if _reducer(opt_state) is None:
        return ("dense_bytes",)
    return ("bytes_sent", *(("fast_bytes_sent",) if pair else ()), "dense_bytes")


def _bytes_of(opt_state: Any, grads: Any, pair: bool) -> dict[str, jax.Array]:
    """This worker's ``bytes_sent`` (and, over a ``(slow, fast)`` ``pair``,
    ``fast_bytes_sent``) in the reducing transform's state (:func:`_reducer`), and
    ``dense_bytes``, each ``float32[1]`` (one row per worker in the step's output).

    Under ``accordion_batch_size`` the inner mean sends only on the micro-steps that update
    (``mini_step == 0`` after the update).
    """
    from jaxcomp import compressors
    from jaxcomp import transforms

    out = {}
    x = _reducer(opt_state)
    if isinstance(x, transforms.AccordionBatchState):
        inner = _reducer(x.inner)
        updated = x.mini_step == 0
        sent = jnp.where(updated, inner.bytes_sent, 0.0)
        fast = jnp.where(updated, inner.fast_bytes_sent, 0.0)
    elif x is not None:
        sent, fast = x.bytes_sent, x.fast_bytes_sent
    if x is not None:
        out["bytes_sent"] = jnp.asarray(sent, jnp.float32).reshape(1)
        if pair:
            out["fast_bytes_sent"] = jnp.asarray(fast, jnp.float32).reshape(1)
    dense = sum(float(compressors.dense_bytes(g)) for g in jax.tree.leaves(grads))
    out["dense_bytes"] = jnp.full((1,), dense, jnp.float32)
    return out


def _worker_axes(axis_name: Any, mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """``(axis,)`` or ``(slow, fast)``, each an axis of ``mesh`` (``ValueError`` otherwise)."""
    slow, fast = _compressed_mean.split_axes(axis_name)
    if slow is None:
        raise ValueError("data_parallel needs an axis_name (or a (slow, fast) pair); got None.")
    axes = (slow,) if fast is None else (slow, fast)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(f"axis_name {a!r} is not an axis of the mesh {mesh.axis_names}.")
    return axes
