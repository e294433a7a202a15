"""The compiled programs of grouped AB-Training data parallelism, and when each one runs.

A step of :func:`~jaxcomp.transforms.ab_training` is one of four kinds; instead of one program that
picks the kind with ``lax.switch`` (which on the CPU backend costs as much as the step itself:
``jaxcomp._cpu`` [slow-ops]), the harness compiles three programs and the host strings them together
by the step index (:func:`schedule_programs`):

* ``dense``: gradients averaged over all workers, every parameter updated;
* ``ab`` and ``ab_then_sync`` (the last AB step of a cycle): one compiled program with a
  ``sync`` flag: the group's factor and the non-factorised parameters updated, then ``W = A
  B``, or the groups' sync, which rebuilds ``W`` from the synced factors
  (:func:`~jaxcomp.ab._sync.reconstruct_or_sync`: ``W`` is computed once, and a
  sync costs no program of its own);
* ``factorise`` (before the first AB step) and ``refactor`` (after the last full-rank step of
  a cycle): one compiled program with an ``exact`` flag, without the model.

Every program is compiled ahead of time, before anything runs (:class:`Programs`), so that no
compilation competes with a running multi-device step for the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _compile
from jaxcomp import _cpu
from jaxcomp import _driver
from jaxcomp import _finite
from jaxcomp._driver import TrainState
from jaxcomp.ab import _forward
from jaxcomp.ab import _step
from jaxcomp.ab import _sync
from jaxcomp.ab._config import ABConfig
from jaxcomp.ab._config import num_a_groups
from jaxcomp.ab._layout import build_layout
from jaxcomp.ab._metrics import ab_metrics
from jaxcomp.ab._metrics import collectives_by_role
from jaxcomp.ab._step import Ctx
from jaxcomp.ab._topology import topology
from jaxcomp.ab._transform import advance
from jaxcomp.ab._transform import check_shapes
from jaxcomp.comm import local_value_and_grad
from jaxcomp.comm import to_varying
from jaxcomp.comm import varying_axes

#: The compiled programs; in a schedule, ``"factorise"`` is ``"refactor"`` with ``exact`` and
#: ``"ab_then_sync"`` is ``"ab"`` with ``sync``.
PROGRAMS = ("dense", "ab", "refactor")
_STEPS = ("dense", "ab")  # run every step: compiled with XLA's default options
_PROGRAM_OF = {"factorise": "refactor", "ab_then_sync": "ab"}


def schedule_programs(config: ABConfig, step: int) -> tuple[str, ...]:
    """The programs that make up the step with index ``step`` (host ints)."""
    kind = config.schedule.step_kind(step)
    if kind.startswith("dense"):
        return ("dense", "refactor") if kind == "dense_then_refactor" else ("dense",)
    first = ("factorise",) if step == config.warmup_steps else ()
    return (*first, "ab_then_sync" if kind == "ab_then_sync" else "ab")


def _unstack(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _stack(tree):
    return jax.tree.map(lambda x: x[None], tree)


@dataclasses.dataclass
class Programs:
    """The programs of one config, loss and mesh, compiled on first use (ahead of time).

    Attributes:
      config: the :class:`~jaxcomp.transforms.ABConfig`.
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      mesh: the mesh holding ``config.axis_name``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      has_state: ``loss_fn(params, model_state, batch)`` returns the new model state too
        (``(loss, model_state)``, or ``(loss, (aux, model_state))`` with ``has_aux``), as
        :func:`~jaxcomp.parallel.data_parallel` takes it; the state is each worker's own.
      donate: donate the state's buffers to each program's result; without it a program
        returns only the leaves it writes and :meth:`run` reuses the others (no copies).
      check_finite: report whether each worker's loss and new state are finite (one pass
        over what a program writes); if False, ``finite`` is always 1.
      factored_forward: a forward hook (:mod:`._forward`): the AB program runs the model on
        the factors where the hook computes a layer from them (``(x A) B``); ``None``: on
        the dense weights, the factors' gradients from the dense one.
      loss_scaling: the training programs' batch is ``(batch, scale)``: they differentiate
        the loss times ``scale`` (a replicated ``float32[]``) and divide the loss and the
        gradients by it (float16 compute's loss scale).
    """

    config: ABConfig
    loss_fn: Callable[..., Any]
    mesh: jax.sharding.Mesh
    has_aux: bool = False
    donate: bool = True
    check_finite: bool = True
    has_state: bool = False
    factored_forward: _forward.ForwardHook | None = None
    loss_scaling: bool = False

    def __post_init__(self):
        self._programs: dict[str, _driver.Program] = {}  # compile caches, not training state
        # the programs' flags, placed once: a host-to-device copy per step held each step back
        self._flags: dict[bool, jax.Array] = {}
        # which leaves each program passes through, per state structure (found when traced)
        self._kept: dict[tuple, tuple] = {}
        # each executable's collectives by role, parsed once (the executable kept alive with it)
        self._reports: dict[int, tuple] = {}
        self.axes = self.config.axis_name
        self.state_axes = self.config.state_axes(self.mesh)
        sizes = self.config.group_sizes([self.mesh.shape[a] for a in self.axes])
        # the workers, in mesh order, whose group trains A (the first groups: _topology)
        n_a = sum(sizes[: num_a_groups(self.config.sync_mode, len(sizes))])
        self._role_a = np.arange(sum(sizes)) < n_a

    # ---- bodies (inside shard_map, one worker's slice) ------------------------------------

    def _ctx(self, params) -> Ctx:
        return Ctx(self.config, build_layout(params, self.config.exclude), topology(self.config))

    def _train_body(self, kind: str):
        def body(state: TrainState, batch, *sync):
            read = _unstack((state.params, state.opt_state, state.model_state))
            params, opt, model_state = read
            loss_fn = _driver.stateful_loss(self.loss_fn, self.has_aux, self.has_state)
            if self.loss_scaling:  # the batch and the scale (replicated)
                batch, scale = batch
                loss_fn = _scaled_loss(loss_fn, scale)
            ctx = self._ctx(params)
            if kind == "dense" or self.factored_forward is None:
                (loss, (aux, model_state)), grads = local_value_and_grad(
                    loss_fn, self.axes, has_aux=True
                )(params, model_state, batch)
                check_shapes(ctx.layout, opt, grads, params)
            else:  # the factorised forward: the factors' gradients, no dense one
                check_shapes(ctx.layout, opt, params, params)
                (loss, (aux, model_state)), g_other, g_factors = _forward.value_and_grads(
                    self.factored_forward, loss_fn, self.axes, ctx.layout, params, opt.a, opt.b,
                    model_state, batch,
                )  # fmt: skip
                grads = ctx.layout.merge(g_factors, g_other)
            if self.loss_scaling:  # exact: the scale is a power of two
                loss, grads = jax.tree.map(lambda x: x / scale.astype(x.dtype), (loss, grads))
            lr = jnp.asarray(self.config.lr_schedule()(opt.count), jnp.float32)
            if kind == "dense":
                params, opt = _step.dense_update(ctx, grads, opt, params, lr)
                changed = (params, opt.dense_state, opt.other_state)
            else:  # W = A B, or the sync (``sync``: a replicated flag, so uniform)
                params, opt = _step.ab_update(ctx, grads, opt, params, lr, reconstruct=False)
                params, opt, model_state = _sync.reconstruct_or_sync(
                    ctx, opt, params, model_state, sync[0]
                )
                changed = (params, opt.a, opt.b, opt.a_state, opt.b_state, opt.other_state,
                           *((opt.dense_state,) if self.config.reset_opt else ()))  # fmt: skip
            opt = advance(self.config, opt, opt.count)
            changed = (changed, model_state)
            if kind != "dense":
                loss, aux = _after_update((loss, aux), params)
            loss = lax.pmean(loss, self.axes)  # non-finite if any worker's is
            workers = {"lr": lr, **_state_metrics(self.check_finite, changed, params, opt, loss)}
            metrics = {"loss": loss, "workers": _stack(workers)}
            if self.has_aux:
                metrics["aux"] = jax.tree.map(lambda a: lax.pmean(a, self.axes), aux)
            new = self._written(kind, state, read, state.step + 1, (params, opt, model_state))
            return new, metrics

        return body

    def _transition_body(self, name: str):
        def body(state: TrainState, exact: jax.Array):
            read = _unstack((state.params, state.opt_state, state.model_state))
            params, opt, model_state = read
            ctx = self._ctx(params)
            # factorise and refactor: one program, the flag is an input (replicated: uniform)
            params, opt = _sync.refactor(ctx, opt, params, exact=exact)
            changed = (params, opt.a, opt.b, opt.a_state, opt.b_state, model_state)
            workers = _stack(_state_metrics(self.check_finite, changed, params, opt))
            new = self._written(name, state, read, state.step, (params, opt, model_state))
            return new, {"workers": workers}

        return body

    def _written(self, name: str, state: TrainState, read: tuple, step, new: tuple) -> TrainState:
        """The program's new state, stacked: all of it when the state is donated (XLA aliases
        what passes through), else only the leaves the body wrote.

        Without donation every output is a fresh buffer, so a leaf passed through unchanged
        (the dense moments in an AB step, the factors in a dense one, most of the state in a
        transition) would be copied on every worker at every step. A leaf counts as passed
        through only if the body returned the very value it read (the same traced object),
        so nothing the body computed can be left out; :meth:`run` puts the old leaves back.
        ``read``: the unstacked ``(params, opt_state, model_state)`` the body read.
        """
        if self.donate:
            return TrainState(step, *_stack(new))
        masks, parts = [], []
        for field, before, after in zip(TrainState._fields[1:], read, new):
            b, tree_b = jax.tree.flatten(before)
            a, tree_a = jax.tree.flatten(after)
            if tree_a != tree_b:  # pragma: no cover - a program changes no structure
                raise ValueError(f"program {name!r} changed the structure of state.{field}: "
                                 f"{tree_b} -> {tree_a}.")  # fmt: skip
            kept = tuple(x is y for x, y in zip(a, b))
            masks.append(kept)
            parts.append(tuple(x[None] for x, k in zip(a, kept) if not k))
        step_kept = step is state.step
        self._kept[name, jax.tree.structure(state)] = (step_kept, tuple(masks))
        return TrainState(() if step_kept else (step,), *parts)

    def _merged(self, name: str, state: TrainState, out: TrainState) -> TrainState:
        """``state`` with the leaves program ``name`` wrote (``out``, see :meth:`_written`)."""
        if self.donate:
            return out
        step_kept, masks = self._kept[name, jax.tree.structure(state)]
        fields = [state.step if step_kept else out.step[0]]
        for before, kept, written in zip(state[1:], masks, out[1:]):
            leaves, tree = jax.tree.flatten(before)
            it = iter(written)
            fields.append(tree.unflatten([x if k else next(it) for x, k in zip(leaves, kept)]))
        return TrainState(*fields)

    def _program(self, name: str) -> _driver.Program:
        if name not in self._programs:
            # the model state (BatchNorm statistics) is each worker's own, even where the
            # members of a group agree on the parameters
            specs = TrainState(P(), P(self.state_axes), P(self.state_axes), P(self.axes))
            # per-worker metrics: one entry per state entry, or per worker with a model state
            # (its finiteness is each worker's own)
            workers = {"workers": P(self.axes if self.has_state else self.state_axes)}
            if name in ("dense", "ab"):
                metrics = {"loss": P(), **workers, **({"aux": P()} if self.has_aux else {})}
                flag = (P(),) if name == "ab" else ()
                batch = (P(self.axes), P()) if self.loss_scaling else P(self.axes)
                in_out = ((specs, batch, *flag), (specs, metrics))
                body = self._train_body(name)
            else:
                in_out = ((specs, P()), (specs, workers))
                body = self._transition_body(name)
            # the re-factorisation runs a few times a run: on CPU compiled fast, not optimised
            options = None if name in _STEPS else _cpu.rarely_run_options(self.mesh)
            self._programs[name] = _driver.Program(
                body, self.mesh, lambda *_: in_out, donate=self.donate, compiler_options=options
            )
        return self._programs[name]

    def _sharded(self, name: str):
        """The ``jax.jit`` function of program ``name`` (to lower, trace or export)."""
        return self._program(name).jitted()

    # ---- compile and run ----------------------------------------------------------------

    def _args(self, name: str, state, batch=None):
        if name == "dense":
            return (state, batch)
        value = name in ("factorise", "ab_then_sync")
        if value not in self._flags:
            self._flags[value] = jax.device_put(np.asarray(value), NamedSharding(self.mesh, P()))
        flag = self._flags[value]
        return (state, batch, flag) if name in ("ab", "ab_then_sync") else (state, flag)

    def compiled(self, name: str, *args):
        """The compiled program ``name`` for arguments shaped like ``args``.

        A program not compiled yet for these shapes is compiled here, after waiting for
        ``args`` (so that no compilation runs beside a multi-device step).
        """
        return self._program(_PROGRAM_OF.get(name, name)).compiled(*args)

    def bytes_sent(self, name: str, state: TrainState, batch=None) -> np.ndarray:
        """``float32[N]``: the bytes each worker (in mesh order) puts into the collectives of
        program ``name`` run on ``state`` (and ``batch``), read from its compiled HLO: the
        shared collectives and those of the worker's role (:func:`collectives_by_role`), and
        the groups' sync for ``"ab_then_sync"``."""
        exe = self.compiled(name, *self._args(name, state, batch))
        if id(exe) not in self._reports:
            self._reports[id(exe)] = exe, collectives_by_role(exe.as_text())
        by = self._reports[id(exe)][1]
        if _PROGRAM_OF.get(name, name) != "ab":
            sent = np.full(self._role_a.shape, by["shared"].total_bytes)
        else:
            sent = np.where(self._role_a, by["a"].total_bytes, by["b"].total_bytes)
            if name == "ab_then_sync":
                sent = sent + by["sync"].total_bytes
        return sent.astype(np.float32)

    def run(self, name: str, state: TrainState, batch=None):
        args = self._args(name, state, batch)
        new, out = self.compiled(name, *args)(*args)
        return self._merged(_PROGRAM_OF.get(name, name), state, new), out

    def compile_all(
        self, state: TrainState, batch, also: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Compiles every program for ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``s)
        and returns them by name (:data:`PROGRAMS`).

        The programs are lowered one by one, each compiled as soon as it is lowered, side by
        side in threads (:func:`jaxcomp._compile.compile_all`), with ``also``: other programs
        (a mode's state init and evaluation), lowered or functions lowering them, returned by
        their names too.
        """
        # arrays: compiled once they are ready, never beside a running step
        ready = [x for x in jax.tree.leaves((state, batch)) if isinstance(x, jax.Array)]
        jax.block_until_ready(ready)
        args = {name: self._args(name, state, batch) for name in PROGRAMS}
        # lowered as compile_all reaches them: each beside the compiles of those before it
        lowered = {
            name: _compile.lower_later(self._program(name), *a)
            for name, a in args.items()
            if not self._program(name).has_compiled(*a)
        }
        clash = sorted(set(also or ()) & set(PROGRAMS))
        if clash:
            raise ValueError(f"compile_all: also names {clash} clash with the programs' names.")
        # the steps first, the re-factorisation (the quickest compile) last: the compiles
        # that start last end together
        steps = {n: low for n, low in lowered.items() if n in _STEPS}
        rest = {n: low for n, low in lowered.items() if n not in steps}
        compiled = _compile.compile_all({**steps, **(also or {}), **rest})
        for name in lowered:
            self._program(name).adopt(compiled[name], *args[name])
        # the executables the programs keep (and run), not those just compiled beside them
        return {**compiled, **{name: self.compiled(name, *a) for name, a in args.items()}}


def _scaled_loss(loss_fn, scale):
    """``loss_fn`` with its loss multiplied by ``scale``."""

    def scaled(*args):
        loss, rest = loss_fn(*args)
        return loss * scale.astype(loss.dtype), rest

    return scaled


def _after_update(metrics, params):
    """``metrics``, computed after the step's new ``params`` (the same values).

    XLA schedules an all-reduce as soon as its operand is ready: the loss's all-worker mean
    ran right after the forward pass, the first of an AB step's three collective points, and
    every device thread waited there for the last one launched (the group means of the
    gradients and the sync come after the backward pass). A data dependency on the new
    parameters moves it to the end of the step, beside the others: a select on a flag that
    is always true, read from them (:func:`jaxcomp._cpu.after`, on CPU), so every value
    passes bit for bit (NaN, -0.0 too). A leaf that does not vary over every axis the flag
    varies over (an aux metric that is a constant, or read from the parameters only) is left
    where XLA puts it: the select would change its type. The dense program needs none of
    this: XLA combines its loss mean with the gradients' all-reduce.
    """
    true = _cpu.after(jnp.ones((), jnp.float32), jax.tree.leaves(params)) == 1
    needs = varying_axes(true)

    def late(x):
        return jnp.where(true, x, jnp.zeros_like(x)) if needs <= varying_axes(x) else x

    return jax.tree.map(late, metrics)


def _state_metrics(check: bool, changed, params, opt, loss=None) -> dict[str, jax.Array]:
    """This worker's: whether what the program changed (and the loss) is finite; count, phase
    and ranks (their mean and each factorised parameter's, in tree order).

    Per worker (no collective): the host combines them over the workers. Only the parts of
    the state a program writes are checked (the rest was checked when it was written).
    """
    scalars = () if loss is None else (loss,)
    # stacked, as the program returns them: the check reads the very values it writes
    out = {"finite": _finite_as_written(_stack(changed) if check else (), scalars)}
    if loss is not None:
        m = ab_metrics(opt, params)
        out.update(count=opt.count, phase=m["phase"], compression_ratio=m["compression_ratio"],
                   mean_rank=m["rank"].astype(jnp.float32).mean(), rank=m["rank"])  # fmt: skip
    return out


def _finite_as_written(tree, scalars: tuple) -> jax.Array:
    """:func:`jaxcomp._driver.all_finite` of ``tree`` and ``scalars``, read from the
    values as the program writes them (:func:`jaxcomp._cpu.as_written`: on CPU a written leaf
    is otherwise computed a second time inside the check; no collective inside, so the flag
    may vary over the workers).
    """
    inexact = _finite.inexact_leaves((tree, scalars))
    first = [x for x in inexact if x.size][:1]
    if not first or not jax.tree.leaves(tree):  # nothing written to read twice
        return _driver.all_finite(tree, *scalars)
    # the result varies where the leaves it reads do
    never = to_varying(jnp.zeros((), jnp.int32), sorted(set().union(*map(varying_axes, inexact))))
    check = lambda tree, scalars: _driver.all_finite(tree, *scalars)  # noqa: E731
    return _cpu.as_written(check, never, (tree, scalars), first)


def abstract_train_state(
    config: ABConfig, params: Any, mesh: jax.sharding.Mesh, model_state: Any = ()
) -> TrainState:
    """``ShapeDtypeStruct``s (with shardings) of the harness's train state for ``params`` (and
    a model state, per worker over all of ``config.axis_name``)."""
    opt = jax.eval_shape(lambda p: _step.init_state(config, p), params)
    params, model_state = jax.eval_shape(lambda t: t, (params, model_state))
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    placed = _driver.stack_per_worker((params, opt), mesh, config.state_axes(mesh))
    return TrainState(step, *placed, _driver.stack_per_worker(model_state, mesh, config.axis_name))
