"""Grouped data parallelism for AB-Training: the mesh, the per-worker layout, the train step.

During AB phases the workers hold different factors and weights, so every AB-Training array
carries a leading axis of one entry per worker, sharded over ``ABConfig.axis_name``
(:func:`stack_per_worker`); inside ``shard_map`` each worker sees its own entry. The train step runs
the compiled programs of :mod:`._programs` in the order the step index asks for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _compile
from jaxcomp import _cpu
from jaxcomp import _driver
from jaxcomp import _fetch
from jaxcomp import compressors
from jaxcomp._driver import TrainState
from jaxcomp.ab import _factor as F
from jaxcomp.ab import _programs
from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._config import num_a_groups
from jaxcomp.ab._forward import ForwardHook
from jaxcomp.ab._metrics import collectives_by_role
from jaxcomp.ab._step import ABTrainingState
from jaxcomp.ab._step import init_state
from jaxcomp.comm import GROUP
from jaxcomp.comm import MEMBER
from jaxcomp.comm import make_mesh


def ab_mesh(num_groups: int, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The ``(group, member)`` mesh: the data-parallel workers split into ``num_groups`` groups.

    For groups of unequal size use a flat mesh (``comm.make_mesh([("data", N)])``) with
    ``ABConfig(axis_name="data", group_size=...)``.

    Args:
      num_groups: number of independent groups; must divide the number of devices.
      devices: the data-parallel workers (default: all devices).

    Returns:
      A mesh with axes ``("group", "member")`` of sizes ``(num_groups, len(devices) //
      num_groups)``; consecutive devices share a group (e.g. the GPUs of one node).

    Raises:
      ValueError: if ``num_groups`` is not a positive divisor of the number of devices.

    Example:
      >>> mesh = ab_mesh(2, jax.devices()[:8])  # doctest: +SKIP
      >>> dict(mesh.shape)  # doctest: +SKIP
      {'group': 2, 'member': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int; got {num_groups!r}.")
    if len(devices) % num_groups:
        raise ValueError(
            f"num_groups={num_groups} does not divide the data axis of {len(devices)} devices; "
            f"use one of {[g for g in range(1, len(devices) + 1) if len(devices) % g == 0]}, "
            "or a flat axis with ABConfig(group_size=...) for unequal groups."
        )
    return make_mesh([(GROUP, num_groups), (MEMBER, len(devices) // num_groups)], devices)


def stack_per_worker(
    tree: Any, mesh: jax.sharding.Mesh, axis_name: str | Sequence[str] = (GROUP, MEMBER)
) -> Any:
    """Copies every leaf once per entry of ``axis_name``: ``[N, ...]``, sharded over it.

    Use it on the parameters and the :func:`~jaxcomp.transforms.ab_training` state (from
    ``tx.init`` on the unstacked parameters) before the first step, with ``axis_name`` the
    worker axes or, as the harness does, ``config.state_axes(mesh)`` (one entry per group
    when the members of a group agree).
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    return _driver.stack_per_worker(tree, mesh, axes)


def worker_entry(tree: Any, worker: int = 0) -> Any:
    """Entry ``worker`` (a worker's, or a group's) of a per-worker tree (a host copy)."""
    return jax.tree.map(lambda x: x[worker], _fetch.fetch(tree))


class ABDataParallel(NamedTuple):
    """What :func:`ab_data_parallel` returns.

    Attributes:
      init: ``init(params, model_state=()) -> TrainState``: parameters and optimizer state
        with a leading axis over ``config.state_axes(mesh)``: one entry per group when the
        members of a group agree (a ``(group, member)`` mesh with ``comm_setup="groups"``),
        else per worker; the model state (``has_state``) always per worker.
      step: ``step(state, batch) -> (state, metrics)``; reads ``state.step`` on the host to
        choose the programs (so it waits for the previous step to finish).
      shard_batch: places a host batch on the mesh (``step`` calls it too).
      state_sharding: ``state_sharding(params, model_state=()) -> TrainState`` of
        ``NamedSharding`` values.
      abstract_state: ``abstract_state(params, model_state=()) -> TrainState`` of
        ``ShapeDtypeStruct`` values with
        their shardings (an orbax restore target, or :attr:`compile`'s input).
      mesh: the mesh.
      axis_name: the workers' axes.
      config: the :class:`~jaxcomp.transforms.ABConfig`.
      compile: ``compile(state, batch, also=None)``: compiles every program ahead of time
        (arrays or ``ShapeDtypeStruct`` values), side by side in threads with ``also`` (other
        lowered programs by name, e.g. the model's init), and returns them all by name.
      step_bytes: ``step_bytes(state, batch) -> {kind: {role: bytes}}``: collective bytes per
        worker of each step kind, read from the compiled programs' HLO; roles ``"a"``/``"b"``
        (and their worker-weighted ``"mean"``) for AB kinds, ``"all"`` for dense ones.
    """

    init: Callable[..., TrainState]
    step: Callable[..., tuple[TrainState, dict[str, Any]]]
    shard_batch: Callable[[Any], Any]
    state_sharding: Callable[..., TrainState]
    abstract_state: Callable[..., TrainState]
    mesh: jax.sharding.Mesh
    axis_name: tuple[str, ...]
    config: ABConfig
    compile: Callable[..., dict[str, Any]]
    step_bytes: Callable[..., dict[str, dict[str, float]]]


def ab_data_parallel(
    loss_fn: Callable[..., Any],
    config: ABConfig,
    mesh: jax.sharding.Mesh,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    donate: bool = True,
    check_finite: bool = True,
    factored_forward: ForwardHook | None = None,
    loss_scaling: bool = False,
) -> ABDataParallel:
    """A grouped data-parallel trainer for :func:`~jaxcomp.transforms.ab_training`.

    Each worker takes the gradient of its shard of ``batch`` with
    :func:`jaxcomp.comm.local_value_and_grad` (no hidden all-reduce); the AB-Training steps do
    all the communication. The step kinds run as separately compiled programs chosen on the
    host (:mod:`jaxcomp.ab._programs`), each compiled before it first runs while
    nothing else runs. On a CPU mesh it switches the CPU door on for the mesh
    (:func:`jaxcomp._cpu.for_mesh`: one-thread BLAS with several local devices).

    A Flax NNX model goes in whole, as in :func:`~jaxcomp.parallel.data_parallel`:
    ``init(model)`` with an ``nnx.Module`` and ``loss_fn(model, batch)``; AB-Training factors
    the matrices of its ``nnx.Param`` variables, and ``state.module(worker)`` merges a
    worker's parameters back into a module.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), the
        mean over this worker's shard of the batch; ``loss_fn(model, batch)`` for an NNX
        model.
      config: the :class:`~jaxcomp.transforms.ABConfig`.
      mesh: a mesh with ``config.axis_name`` (e.g. :func:`ab_mesh`); ``batch`` leaves are
        split over those axes along their first dimension.
      has_aux: ``metrics["aux"]`` is ``aux`` averaged over all workers.
      has_state: the model has mutable state (BatchNorm running statistics), as in
        :func:`~jaxcomp.parallel.data_parallel`: ``loss_fn(params, model_state, batch)``
        returns ``(loss, model_state)`` (``(loss, (aux, model_state))`` with ``has_aux``).
        Each worker keeps its own (``[N, ...]`` over all of ``config.axis_name``), updated
        by its own forward passes only (a model that synchronises its statistics over the
        group, e.g. BatchNorm with ``batch_axis``, makes a group's workers agree). At a
        sync it follows the non-factorised parameters' rule
        (:attr:`~jaxcomp.transforms.ABConfig.effective_dense_sync`,
        :func:`jaxcomp.ab._sync.sync_model_state`).
      donate: donate the old state's buffers to the new one.
      check_finite: report in ``metrics["finite"]`` whether the loss and each worker's new
        state are finite (a pass over what each program writes; on CPU about as long as a
        third of the digits MLP's dense step).
      factored_forward: the factorised forward's hook, e.g. :func:`jaxcomp.models.factored_dense`
        for Flax ``nn.Dense`` layers: in AB steps a layer it computes from the factors runs as
        :math:`(x A) B` instead of :math:`x W` where that is cheaper, its factor's gradient
        from the backward pass instead of from the dense gradient (:mod:`jaxcomp.ab._forward`;
        the same numbers up to float summation order). ``None``: the dense weights.
      loss_scaling: the step takes a loss scale, ``step(state, batch, loss_scale)`` (a
        ``float32`` scalar, replicated on the mesh or on the host; a power of two): the
        training programs differentiate the loss times ``loss_scale`` and divide the
        gradients (and the reported loss) by it before anything else reads them, as
        float16 compute's dynamic loss scaling needs (Micikevicius et al., 2018). Choosing
        the scale (halved after a non-finite step, grown after finite ones) is the caller's.

    Returns:
      An :class:`ABDataParallel`. Its ``metrics``: ``loss`` (averaged over all workers) and
      ``aux`` (with ``has_aux``), and per worker (``[N]`` arrays, combined on the host: no
      collective is added to the step): ``lr`` (the learning rate used), ``finite`` (1 if
      the loss and the worker's new parameters and optimizer state are finite; if any is 0,
      keep the previous state, which is not donated with ``donate=False``), ``count``,
      ``phase``, ``compression_ratio``, ``mean_rank`` and ``rank`` (``[.., L]``: each
      factorised parameter's rank, in tree order) (:func:`~jaxcomp.transforms.ab_metrics`);
      and, as :func:`~jaxcomp.parallel.data_parallel`'s step, ``bytes_sent`` (``float32[W]``,
      host values: per worker in mesh order, the bytes it put into the step's collectives,
      read from the compiled programs' HLO by the worker's role: the programs of this step's
      kind, the re-factorisation and the groups' sync where they run) and ``dense_bytes``
      (``float32[W]``: the bytes of the dense gradient, what a dense average would send).

    Raises:
      ValueError: if ``config`` is not an ``ABConfig`` or the mesh lacks its axes.

    Example:
      >>> # mesh = ab_mesh(num_groups=2)
      >>> # dp = ab_data_parallel(loss_fn, ABConfig(1e-3, warmup_steps=..., ...), mesh)
      >>> # state = dp.init(params); state, metrics = dp.step(state, batch)
    """
    if not isinstance(config, ABConfig):
        raise ValueError(f"ab_data_parallel needs an ABConfig; got {type(config).__name__}.")
    axes = config.axis_name
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"the mesh {dict(mesh.shape)} has no axis {missing} of "
                         f"ABConfig.axis_name={axes}.")  # fmt: skip
    sizes = config.group_sizes([mesh.shape[a] for a in axes])  # raises for impossible groups
    num_workers = sum(sizes)
    _cpu.for_mesh(mesh)  # on CPU: one-thread BLAS for the re-factorisation's SVDs
    programs = _programs.Programs(config, loss_fn, mesh, has_aux, donate, check_finite,
                                  has_state, factored_forward, loss_scaling)  # fmt: skip
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P(axes))
    state_axes = config.state_axes(mesh)
    # one jit for every call: compile_all compiles it beside the step programs
    init_opt = jax.jit(functools.partial(init_state, config))

    def init(params, model_state=()):
        params, model_state = _driver.split_model(params, model_state)
        if jax.tree.leaves(model_state) and not has_state:
            raise ValueError("a model_state was given to an ab_data_parallel built without "
                             "has_state (an NNX module with state besides its parameters, "
                             "e.g. BatchNorm statistics, needs has_state=True too).")  # fmt: skip
        opt = init_opt(params)
        # from the host: a fresh buffer, and no eager op to compile (jnp.zeros and the copy
        # in _driver.replicate compiled three tiny programs)
        step0 = jax.device_put(np.zeros((), np.int32), NamedSharding(mesh, P()))
        placed = _driver.stack_per_worker((params, opt), mesh, state_axes)
        return TrainState(step0, *placed, _driver.stack_per_worker(model_state, mesh, axes))

    def shard_batch(batch):
        _driver.check_divisible(batch, mesh, axes)
        return jax.device_put(batch, split)

    def step(state, batch, loss_scale=None):
        _driver.layout_of(state, mesh)  # raises for a state that does not live on the mesh
        if (loss_scale is None) == loss_scaling:
            raise ValueError(
                "ab_data_parallel(loss_scaling=True)'s step needs a loss_scale" if loss_scaling
                else "a loss_scale was given to an ab_data_parallel built without loss_scaling."
            )  # fmt: skip
        t = int(state.step)  # the step kind picks the programs: read on the host
        batch = shard_batch(batch)
        if loss_scaling:
            batch = (batch, jax.device_put(_as_float32(loss_scale), replicated))
        metrics, finite = {}, []
        sent = np.zeros(num_workers, np.float32)
        for name in _programs.schedule_programs(config, t):
            sent += programs.bytes_sent(name, state, batch)  # from the HLO: no sync, no transfer
            if name in ("dense", "ab", "ab_then_sync"):
                state, out = programs.run(name, state, batch)
                metrics = {k: v for k, v in out.items() if k != "workers"}
                metrics.update(out["workers"])
            else:
                state, out = programs.run(name, state)
                finite.append(out["workers"]["finite"])
        if finite:  # the transitions' results must be finite too (combined on the host: an
            # eager jnp.minimum compiled a program of its own at the first transition)
            flags = _fetch.fetch((metrics["finite"], *finite))  # every process's workers
            metrics["finite"] = np.min(flags, 0)
        metrics["bytes_sent"] = sent
        # what a dense all-reduce of the gradient would send: one worker's parameters
        dense = sum(compressors.dense_bytes(jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
                    for x in jax.tree.leaves(state.params))  # fmt: skip
        metrics["dense_bytes"] = np.full(num_workers, dense, np.float32)
        return state, metrics

    def abstract_state(params, model_state=()):
        params, model_state = _driver.split_model(params, model_state)
        return _programs.abstract_train_state(config, params, mesh, model_state)

    def state_sharding(params, model_state=()):
        return jax.tree.map(lambda x: x.sharding, abstract_state(params, model_state))

    def compile_all(state, batch, also=None):
        # the factors' init too, for the unstacked parameters init() is given
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
        also = {"init_opt": _compile.lower_later(init_opt, params), **(also or {})}
        batch = shard_abstract(batch)
        if loss_scaling:
            batch = (batch, jax.ShapeDtypeStruct((), np.float32, sharding=replicated))
        return programs.compile_all(state, batch, also)

    def shard_abstract(batch):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split)
            if isinstance(x, jax.ShapeDtypeStruct) else shard_batch(x), batch,
        )  # fmt: skip

    def step_bytes(state, batch):
        compiled = compile_all(state, batch)
        return kind_bytes(config, sizes, {n: c.as_text() for n, c in compiled.items()})

    return ABDataParallel(init, step, shard_batch, state_sharding, abstract_state, mesh, axes,
                          config, compile_all, step_bytes)  # fmt: skip


def _as_float32(x: Any) -> Any:
    """``x`` as a ``float32`` scalar; a device array stays on the device."""
    if isinstance(x, jax.Array) and x.dtype == np.float32 and x.shape == ():
        return x
    if isinstance(x, jax.Array):
        return x.astype(np.float32).reshape(())
    return np.asarray(x, np.float32).reshape(())


def kind_bytes(
    config: ABConfig, sizes: Sequence[int], hlo: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """Collective bytes per worker of each step kind from the programs' compiled HLO texts
    (or their :func:`~jaxcomp.ab._metrics.collectives_by_role` reports, parsed
    once for several uses)."""
    num_a = num_a_groups(config.sync_mode, len(sizes))
    n_a, n = sum(sizes[:num_a]), sum(sizes)
    by = {k: collectives_by_role(v) if isinstance(v, str) else v for k, v in hlo.items()}
    total = lambda name, role: by[name][role].total_bytes  # noqa: E731
    dense, refactor = total("dense", "shared"), total("refactor", "shared")
    out = {"dense": {"all": dense}, "dense_then_refactor": {"all": dense + refactor}}
    roles = ("a", "b") if num_a else ("b",)
    for kind, extra in (("ab", 0.0), ("ab_then_sync", by["ab"]["sync"].total_bytes)):
        out[kind] = {r: total("ab", r) + extra for r in roles}
        a = out[kind].get("a", 0.0)
        out[kind]["mean"] = (n_a * a + (n - n_a) * out[kind]["b"]) / n
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def fit_rank_capacity(
    state: ABTrainingState,
    capacity: str | Sequence[int] = "rank",
    *,
    multiple: int = 1,
) -> ABTrainingState:
    """Resizes the stored factors (and their optimizer moments) to a new rank capacity.

    Collectives carry the factors at their capacity, so after a truncated re-factorisation
    the wire saving is only real once the capacity is cut to the ranks. Factors are unused in
    full-rank phases, so a host loop can keep them at full capacity there (for the next
    re-factorisation) and cut them right after it::

      kind = config.schedule.step_kind(int(state.step))
      state, metrics = dp.step(state, batch)  # compiles once per new capacity
      if kind == "dense_then_refactor":
          state = state._replace(opt_state=fit_rank_capacity(state.opt_state, multiple=8))
      elif kind == "ab_then_sync":
          state = state._replace(opt_state=fit_rank_capacity(state.opt_state, "full"))

    Columns beyond a rank are zero (values and moments), so cutting or padding them changes
    nothing numerically; it is the reference's ``change_adam_shapes``.

    Args:
      state: an :class:`~jaxcomp.transforms.ABTrainingState`, per worker or not.
      capacity: ``"rank"`` (the current ranks; reads them from the device), ``"full"``
        (``min(m, n)``) or one int per factorised parameter.
      multiple: round capacities up to a multiple of this (fewer recompilations).

    Returns:
      The resized state (same sharding).
    """
    full = [min(a.shape[-2], b.shape[-1]) for a, b in zip(state.a, state.b)]
    if isinstance(capacity, str):
        if capacity == "full":
            caps = full
        elif capacity == "rank":
            ranks = _fetch.fetch(state.rank).reshape(-1, len(full)).max(axis=0)
            caps = [int(r) for r in ranks]
        else:
            raise ValueError(f"capacity must be 'rank', 'full' or a sequence; got {capacity!r}.")
    else:
        caps = [int(c) for c in capacity]
        if len(caps) != len(full) or any(c < 1 for c in caps):
            raise ValueError(f"capacity needs {len(full)} positive ints; got {capacity!r}.")
    caps = tuple(min(_round_up(c, multiple), f) for c, f in zip(caps, full))

    def resize(state):
        a = tuple(F.resize_rank_axis(x, c, -1) for x, c in zip(state.a, caps))
        b = tuple(F.resize_rank_axis(x, c, -2) for x, c in zip(state.b, caps))
        a_state = F.map_like(
            state.a_state, state.a, lambda i, x: F.resize_rank_axis(x, caps[i], -1)
        )
        b_state = F.map_like(
            state.b_state, state.b, lambda i, x: F.resize_rank_axis(x, caps[i], -2)
        )
        rank = state.rank.clip(max=np.asarray(caps, np.int32)) if caps else state.rank
        return state._replace(rank=rank, a=a, b=b, a_state=a_state, b_state=b_state)

    return jax.jit(resize)(state)
