"""The one driver under the step builders, below both packages that hold one.

:func:`~jaxcomp.parallel.data_parallel` (:mod:`jaxcomp.parallel`) and
:func:`~jaxcomp.parallel.ab_data_parallel` (AB-Training's grouped step, :mod:`jaxcomp.ab`)
differ in what a worker computes; how it runs is shared here:

* **state**: :class:`TrainState` (step, parameters, optimizer state, model state);

* **placement**: fresh replicated copies (:func:`replicate`, so a step may donate them) and
  per-worker stacks ``[N, ...]`` sharded over the worker axes (:func:`stack_per_worker`),
  for arrays and for ``ShapeDtypeStruct`` trees alike (an orbax restore target);
* **programs**: ``jit(shard_map(body))`` with in/out specs given by the arguments
  (:class:`Program`), the state donated, each compiled once per argument layout, ahead of
  time, after the arguments are ready (no compilation beside a running multi-device step);
* **finiteness**: one flag per worker over what a program wrote (:func:`all_finite`),
  without a collective: the host combines the flags.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _compile
from jaxcomp import _nnx
from jaxcomp._finite import all_finite as all_finite


class TrainState(NamedTuple):
    """The state a step builder's ``step`` takes and returns: the step count, the parameters, the
    optimizer state and the model state, each laid out on the mesh as the builder says.

    Attributes:
      step: ``int32[]``, updates applied.
      params: the parameters (:func:`~jaxcomp.parallel.data_parallel`: replicated;
        :func:`~jaxcomp.parallel.ab_data_parallel`: one entry per group or worker).
      opt_state: the optimizer state; :func:`~jaxcomp.parallel.data_parallel` lays it out
        with :func:`jaxcomp.comm.place_state`: leaves
        owned by one worker (error-feedback residuals, Accordion accumulators, marked
        :class:`~jaxcomp.compressors.PerWorker`) are ``[W, ...]`` sharded over the data axis,
        the rest replicated.
      model_state: the model's mutable state (``has_state``; ``()`` otherwise), laid out the
        same way: :class:`~jaxcomp.compressors.PerWorker` parts ``[W, ...]`` sharded over
        data, the rest replicated. For a Flax NNX model, the module without its parameters
        (its graph as static data, its other state as arrays).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = ()

    def module(self, worker: int | None = None) -> Any:
        """The Flax NNX module with these parameters and state (a model given to ``init``
        as an ``nnx.Module``). ``worker``: the entry of a per-worker state (AB-Training's
        ``[N, ...]`` leaves) to take; ``None`` for replicated parameters.

        Raises:
          ValueError: if the state is not an NNX model's.

        Example:
          >>> # state = dp.init(model); state, _ = dp.step(state, batch)
          >>> # nnx.update(model, nnx.state(state.module()))   # the trained weights back
        """
        if not isinstance(self.model_state, _nnx.Rest):
            raise ValueError("this train state was not made from an NNX module.")
        params, rest = self.params, self.model_state
        if worker is not None:
            params, rest = jax.tree.map(lambda x: x[worker], (params, rest))
        return rest.merge(params)


def replicate(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Copies of ``tree``'s leaves, replicated on ``mesh``.

    A replicated ``device_put`` may alias the caller's buffer, which a donating step would
    then invalidate: the copy comes first.
    """
    copies = jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    return jax.device_put(copies, NamedSharding(mesh, P()))


def stack_per_worker(tree: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> Any:
    """Every leaf once per entry of ``axes``: ``[N, ...]`` sharded ``P(axes)``.

    ``ShapeDtypeStruct`` leaves give ``ShapeDtypeStruct``s of the stacked shape and sharding.
    """
    n = int(np.prod([mesh.shape[a] for a in axes]))
    sharding = NamedSharding(mesh, P(axes))

    def stack(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((n, *x.shape), x.dtype, sharding=sharding)
        x = np.asarray(x)
        return jax.device_put(np.broadcast_to(x, (n, *x.shape)), sharding)

    return jax.tree.map(stack, tree)


def layout_of(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """The ``PartitionSpec`` of each leaf of a placed ``tree`` (arrays or abstract).

    Raises:
      ValueError: if a leaf does not live on ``mesh`` (e.g. a state made without ``init``
        or restored without the builder's shardings).
    """

    def spec_of(leaf):
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
            raise ValueError(
                "the train state must live on the mesh: create it with init(params), or restore "
                "it with the shardings of state_sharding(params)."
            )
        return sharding.spec

    return jax.tree.map(spec_of, tree)


def stateful_loss(loss_fn: Callable[..., Any], has_aux: bool, has_state: bool) -> Callable:
    """``loss_fn`` as ``(params, model_state, batch) -> (loss, (aux, model_state))``.

    ``loss_fn`` is ``(params, batch) -> loss`` (``(loss, aux)`` with ``has_aux``), or with
    ``has_state`` ``(params, model_state, batch) -> (loss, model_state)`` (``(loss, (aux,
    model_state))`` with ``has_aux``); ``aux`` is ``None`` without ``has_aux``, the model
    state passes through unchanged without ``has_state``.

    A Flax NNX model's ``model_state`` is a :class:`jaxcomp._nnx.Rest` (:func:`split_model`):
    ``loss_fn(model, batch)`` then gets the module rebuilt from ``params`` and it, and its
    state comes back as ``loss_fn`` left it, whatever ``has_state`` says.
    """

    def fn(params, model_state, batch):
        if isinstance(model_state, _nnx.Rest):
            return _nnx.stateful_loss(loss_fn, has_aux)(params, model_state, batch)
        if has_state:
            loss, out = loss_fn(params, model_state, batch)
            return (loss, out) if has_aux else (loss, (None, out))
        out = loss_fn(params, batch)
        return (out[0], (out[1], model_state)) if has_aux else (out, (None, model_state))

    return fn


def split_model(params: Any, model_state: Any) -> tuple[Any, Any]:
    """``(params, model_state)`` as a step builder's ``init`` was given them, or for a Flax
    NNX module in place of ``params``, its parameters (nested dicts) and its
    :class:`jaxcomp._nnx.Rest`.

    Raises:
      ValueError: if a module comes with a ``model_state`` of its own.
    """
    if not _nnx.is_module(params):
        return params, model_state
    if jax.tree.leaves(model_state):
        raise ValueError("an NNX module carries its own state: give init the module alone.")
    return _nnx.functional(params)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    weak = bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)


def _key(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, P))
    return treedef, tuple(leaves)


class Program:
    """``jit(shard_map(body))`` on ``mesh``, its state donated, compiled once per layout.

    Args:
      body: one worker's ``body(*args)``; the first argument is the state (donated).
      mesh: the mesh.
      specs: ``specs(*args) -> (in_specs, out_specs)`` for arguments (arrays or abstract),
        e.g. read from their shardings with :func:`layout_of`, or fixed.
      donate: donate the first argument's buffers to the result.
      compiler_options: XLA options every compile of this program passes (e.g.
        :func:`jaxcomp._cpu.rarely_run_options`), so that each executable of it is the
        same wherever it is compiled; ``None``: JAX's defaults.

    The compile cache is a cache, not training state: it maps an argument layout (tree
    structure, shapes, dtypes, weak types, shardings) to its executable.
    """

    def __init__(
        self,
        body: Callable[..., Any],
        mesh: jax.sharding.Mesh,
        specs: Callable[..., tuple[Any, Any]],
        *,
        donate: bool = True,
        compiler_options: dict[str, Any] | None = None,
    ):
        self.body, self.mesh, self.specs, self.donate = body, mesh, specs, donate
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self._jitted: dict[tuple, Any] = {}
        self._compiled: dict[tuple, Any] = {}

    def jitted(self, *args: Any) -> Any:
        """The ``jax.jit`` function for arguments laid out like ``args`` (lower, trace,
        export it)."""
        in_specs, out_specs = self.specs(*args)
        key = _key((in_specs, out_specs))
        if key not in self._jitted:
            fn = jax.shard_map(self.body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)
            self._jitted[key] = jax.jit(fn, donate_argnums=(0,) if self.donate else ())
        return self._jitted[key]

    @staticmethod
    def _signature(args: tuple) -> tuple:
        leaves, treedef = jax.tree.flatten(args)
        # dtype objects, not their names: str(dtype) was 90% of this key's 160 us per call
        return (treedef, tuple(
            (x.shape, x.dtype, bool(getattr(x, "weak_type", False)),
             getattr(x, "sharding", None)) for x in leaves
        ))  # fmt: skip

    def has_compiled(self, *args: Any) -> bool:
        """Whether the executable for arguments like ``args`` is compiled already."""
        return self._signature(args) in self._compiled

    def lower(self, *args: Any) -> Any:
        """The ``jax.stages.Lowered`` program for arguments like ``args`` (arrays or
        abstract), to compile elsewhere (:func:`jaxcomp._compile.compile_all`) and hand back
        with :meth:`adopt`."""
        lowered = self.jitted(*args).lower(*jax.tree.map(_abstract, args))
        if self.compiler_options:
            return _compile.WithOptions(lowered, self.compiler_options)
        return lowered

    def adopt(self, compiled: Any, *args: Any) -> None:
        """Keeps ``compiled`` (this program's :meth:`lower` for ``args``, compiled) as the
        executable for arguments like ``args``."""
        self._compiled.setdefault(self._signature(args), compiled)

    def compiled(self, *args: Any) -> Any:
        """The executable for arguments like ``args``; compiled here on first use, after
        waiting for ``args`` (so that no compilation runs beside a multi-device step)."""
        key = self._signature(args)
        if key not in self._compiled:
            jax.block_until_ready([x for x in jax.tree.leaves(args) if isinstance(x, jax.Array)])
            self._compiled[key] = self.lower(*args).compile()
        return self._compiled[key]

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)(*args)


def check_divisible(batch: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> None:
    """Every leaf of a host ``batch`` has a first dimension the workers (the product of
    ``axes``' sizes) divide.

    Raises:
      ValueError: naming the leaf, its rows, the number of workers and the mesh (instead of
        JAX's sharding error).
    """
    workers = math.prod(mesh.shape[a] for a in axes)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = getattr(x, "shape", None) or np.shape(x)
        rows = shape[0] if len(shape) else None
        if rows is None or rows % workers:
            name = f"batch{jax.tree_util.keystr(path)}"  # batch['x'], or the batch itself
            raise ValueError(
                f"{name} has {rows} rows (the batch size), not divisible by the "
                f"{workers} workers of the mesh {dict(mesh.shape)} (axes {list(axes)}): use a "
                f"batch size that is a multiple of {workers}."
            )
