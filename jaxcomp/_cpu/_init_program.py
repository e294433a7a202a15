"""A state init compiled in two programs: its key hashes fast, its float math as XLA's default.

A model's init draws its parameters from threefry hashes (``random_bits``, ``random_fold_in``,
``random_split``: rounds of 32-bit adds, rotations and xors) and turns the bits into floats
(uniform, truncated normal, scaled). At XLA:CPU's default level most of the init's compile is
the threefry loops unrolled and optimised by LLVM, one per hash (the digits MLP: 16 hashes,
ResNet-18: 87). :func:`jit_split_init` compiles the init's jaxpr (nested ``jit`` inlined) as
two programs:

* **A**, the key part: the hashes and the integer, boolean and key equations that feed them
  (allowlisted primitives, fed only by the init's arguments), compiled at backend level 0
  (:data:`LOW_OPTIONS`). Integer arithmetic is exact at every level: A's outputs cannot depend
  on it. Independent hashes of one kind (primitive, parameters, operand types, depth) run as
  one ``vmap`` (row by row the same integers): XLA:CPU's compile grows faster than linearly
  with the number of hash kernels (128 ``fold_in``: 3.2 s at level 0, their ``vmap`` 0.12 s).
* **B**, everything else, compiled with XLA's default options and the caller's ``jit``
  arguments (``out_shardings``), from A's outputs: the bits' integer tails (shifts, ors), their
  bitcast to floats and all float math; opaque equations (``cond``, ``scan``,
  ``custom_jvp_call``, any primitive not allowlisted) whole.

B's float math is the fused program's, from the same bits: the results are ``jax.jit(fn)``'s
bit for bit (``tests/_cpu/test_init_program.py``: every registered model, typed and raw keys,
``out_shardings`` on a mesh; ``tests/train/test_modes.py``: each mode's state init). B is
compiled first, so that XLA places A's outputs where B wants them, as inside the fused
program; A is then compiled to produce them there. The executables are kept by the returned
object, by argument signature: a call after ``.lower(...).compile()`` (e.g. by
:func:`jaxcomp._compile.compile_all`) compiles nothing.

What it saves per model, and what A's run at level 0 costs: ``docs/performance.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxcomp import _compile

#: XLA options of the key part (A): integer arithmetic is exact at any backend level.
LOW_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}

#: Primitives A may hold (each equation also needs integer, boolean or key operands/results).
KEY_PRIMITIVES = frozenset({
    "random_seed", "random_wrap", "random_unwrap", "random_split", "random_fold_in",
    "random_bits", "random_clone", "threefry2x32",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "or", "and", "xor", "not",
    "add", "sub", "mul", "max", "min", "eq", "ne", "lt", "le", "gt", "ge", "select_n",
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "transpose", "slice", "dynamic_slice", "concatenate", "iota", "copy", "copy_p",
})  # fmt: skip

#: A's hashes (threefry, one kernel each): independent ones of a kind run as one ``vmap``.
BATCHED_PRIMITIVES = frozenset({"random_fold_in", "random_bits", "random_split"})

_NESTED_JIT = frozenset({"jit", "pjit"})


def _is_key_typed(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.bool_)


def _unconstrained(params: dict) -> bool:
    """Whether a nested ``jit`` equation only calls its body (no shardings, no donation)."""
    shardings = list(params.get("in_shardings", ())) + list(params.get("out_shardings", ()))
    unspecified = all(type(s).__name__ == "UnspecifiedValue" for s in shardings)
    return unspecified and not any(params.get("donated_invars", ()))


def _eval(env: dict, eqns: Sequence[Any], inline: bool) -> None:
    """Binds ``eqns`` over ``env`` (var -> value), inlining unconstrained nested ``jit``."""

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if inline and name in _NESTED_JIT and _unconstrained(eqn.params):
            inner = eqn.params["jaxpr"]
            inner_env = dict(zip(inner.jaxpr.constvars, inner.consts))
            inner_env.update(zip(inner.jaxpr.invars, invals))
            with eqn.ctx.manager:
                _eval(inner_env, inner.jaxpr.eqns, inline)
            outs = [
                v.val if isinstance(v, jex_core.Literal) else inner_env[v]
                for v in inner.jaxpr.outvars
            ]
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, val in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = val


def _flat_jaxpr(fn: Callable, args: tuple) -> tuple[jex_core.ClosedJaxpr, Any]:
    """``fn``'s jaxpr over the flattened ``args``, nested unconstrained ``jit`` inlined, and
    the output tree."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    leaves = jax.tree.leaves(args)

    def inlined(*flat):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, flat))
        _eval(env, closed.jaxpr.eqns, inline=True)
        return [v.val if isinstance(v, jex_core.Literal) else env[v] for v in closed.jaxpr.outvars]

    flat = jax.make_jaxpr(inlined)(*leaves)
    return flat, jax.tree.structure(out_shape)


class _Plan(NamedTuple):
    """The split of a flat init jaxpr: A's equations in groups (:func:`_groups`), B's
    equations (in order), and what A returns: ``(group, result position)`` pairs, a group of
    several hashes returning its stacked rows (B indexes them, inside its fusions)."""

    groups: list
    b_eqns: list
    exports: list


def _plan(closed: jex_core.ClosedJaxpr) -> _Plan:
    """A: the hashes and the integer and key equations that feed them, fed only by the init's
    arguments; B: everything else (the bits' integer tails as well: their kernels would cost
    A's compile more than B's)."""
    jaxpr = closed.jaxpr
    in_a = set(jaxpr.invars) | set(jaxpr.constvars)
    candidates = []
    for eqn in jaxpr.eqns:
        operands = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
        if (
            eqn.primitive.name in KEY_PRIMITIVES
            and not eqn.effects
            and all(v in in_a for v in operands)
            and all(_is_key_typed(v.aval) for v in (*eqn.invars, *eqn.outvars))
        ):
            candidates.append(eqn)
            in_a.update(eqn.outvars)
    needed: set = set()
    kept = []
    for eqn in reversed(candidates):
        if eqn.primitive.name in BATCHED_PRIMITIVES or any(v in needed for v in eqn.outvars):
            kept.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    in_kept = {id(e) for e in kept}
    b_eqns = [e for e in jaxpr.eqns if id(e) not in in_kept]
    groups = _groups(kept[::-1])
    read = {v for e in b_eqns for v in e.invars if not isinstance(v, jex_core.Literal)}
    read.update(v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal))
    exports = [
        (g, pos)
        for g, group in enumerate(groups)
        for pos in range(len(group[0].outvars))
        if any(e.outvars[pos] in read for e in group)
    ]
    return _Plan(groups, b_eqns, exports)


def _groups(eqns: Sequence[Any]) -> list[list]:
    """``eqns`` (in order) as groups: the hashes of one kind (primitive, parameters, operand
    types) at one depth of the dependency graph form one group, every other equation one of
    its own. XLA:CPU's compile grows faster than linearly with the number of hash kernels
    (128 ``fold_in``s 3.2 s at level 0, one ``vmap`` of them 0.12 s)."""
    depth: dict = {}
    levels = []
    for eqn in eqns:
        d = 1 + max((depth.get(v, 0) for v in eqn.invars if not isinstance(v, jex_core.Literal)),
                    default=0)  # fmt: skip
        depth.update((v, d) for v in eqn.outvars)
        levels.append(d)
    groups: list[list] = []
    index: dict = {}
    # by depth (stable): a group runs where its first member stands, so every member's operands
    # must come before it (NNX's RNG streams fold in counts computed between two hashes)
    for d, eqn in sorted(zip(levels, eqns), key=lambda pair: pair[0]):
        if eqn.primitive.name not in BATCHED_PRIMITIVES:
            groups.append([eqn])
            continue
        params = tuple(sorted((k, repr(p)) for k, p in eqn.params.items()))
        operands = tuple((v.aval.shape, v.aval.dtype) for v in eqn.invars)
        kind = (d, eqn.primitive, params, operands, eqn.ctx)  # ctx: interned, by identity
        if kind in index:
            groups[index[kind]].append(eqn)
        else:
            index[kind] = len(groups)
            groups.append([eqn])
    return groups


def _eval_groups(env: dict, groups: Sequence[Sequence[Any]]) -> list[list]:
    """Binds ``groups`` (:func:`_groups`) over ``env``, a group of several hashes as one
    ``vmap`` over their stacked operands (the same integers: ``vmap`` is the function row by
    row); returns each group's results (stacked rows for a group of several)."""

    def read(v: Any) -> Any:
        if isinstance(v, jex_core.Literal):
            return jax.numpy.asarray(v.val, v.aval.dtype)
        return env[v]

    results = []
    for group in groups:
        eqn = group[0]
        if len(group) == 1:
            _eval(env, group, inline=False)
            results.append([env.get(v) for v in eqn.outvars])
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        stacked = [jax.numpy.stack([read(e.invars[i]) for e in group])
                   for i in range(len(eqn.invars))]  # fmt: skip

        def bind(*xs: Any, eqn: Any = eqn, params: dict = params) -> Any:
            return eqn.primitive.bind(*xs, **params)

        with eqn.ctx.manager:
            outs = jax.vmap(bind)(*stacked)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        _write_rows(env, group, range(len(outs)), outs)
        results.append(outs)
    return results


def _write_rows(env: dict, group: Sequence[Any], positions: Sequence[int], values: Sequence):
    """``env[e.outvars[pos]]`` for each member ``e`` of ``group``: the value, or its row."""
    for pos, value in zip(positions, values):
        for row, e in enumerate(group):
            v = e.outvars[pos]
            if not isinstance(v, jex_core.DropVar):
                env[v] = value if len(group) == 1 else value[row]


def _leaf_signature(x: Any) -> tuple:
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, x.dtype, x.weak_type, x.sharding)
    if isinstance(x, jax.Array):
        weak = getattr(x, "weak_type", False)  # a key array has none
        return (x.shape, x.dtype, weak, x.sharding if x.committed else None)
    aval = jax.typeof(x)
    return (aval.shape, aval.dtype, aval.weak_type, None)


def _signature(args: tuple) -> tuple:
    """What a compiled init is kept under: the arguments' tree, shapes, dtypes and committed
    shardings, the mesh context and whether XLA's optimisations are off (as ``jax.jit``'s own
    cache: a program compiled under ``jax_disable_most_optimizations`` never serves a call
    outside it)."""
    leaves, tree = jax.tree.flatten(args)
    unoptimised = bool(jax.config.read("jax_disable_most_optimizations"))
    return (tree, tuple(_leaf_signature(x) for x in leaves), jax.sharding.get_abstract_mesh(),
            unoptimised)  # fmt: skip


class _SplitCompiled:
    """A's and B's executables: ``B(args, A(args))``."""

    def __init__(self, a: Any, b: Any):
        self.a, self.b = a, b

    def __call__(self, *args: Any) -> Any:
        flat = jax.tree.leaves(args)
        return self.b(*flat, *self.a(*flat))


class _Lowered:
    """What :meth:`SplitInit.lower` returns: ``compile()`` compiles (B, then A), hands the
    program to its :class:`SplitInit` (later calls with these arguments reuse it) and returns
    it. ``plain`` is the ``jax.stages.Lowered`` of the unsplit program when nothing splits,
    else ``None``; ``key_part`` is A as a Python function of the flattened arguments."""

    def __init__(
        self, owner: SplitInit, key: tuple, plain: Any = None, split: Any = None,
        key_part: Callable | None = None,
    ):  # fmt: skip
        self._owner, self._key, self.plain, self._split = owner, key, plain, split
        self.key_part = key_part

    def compile(self) -> Callable:
        if self.plain is not None:
            program = self.plain.compile()
        else:
            b_lowered, lower_a, n_flat, config = self._split
            b = b_lowered.compile()
            a_shardings = tuple(b.input_shardings[0][n_flat:])
            with config():  # lowered in the caller's context (compile_all: another thread)
                a_lowered = lower_a(a_shardings)
            program = _SplitCompiled(a_lowered.compile(), b)
        if self._key is not None:  # None: jax.jit's own arguments (static ones) decide
            self._owner._compiled[self._key] = program
        return program


class SplitInit:
    """``jax.jit(fn, **jit_kwargs)`` for a state init, compiled as :func:`jit_split_init`
    describes; built by :func:`jit_split_init`."""

    def __init__(self, fn: Callable, low_options: dict[str, Any], jit_kwargs: dict[str, Any]):
        self._fn, self._low_options, self._jit_kwargs = fn, dict(low_options), jit_kwargs
        self._jit = jax.jit(fn, **jit_kwargs)
        self._compiled: dict[tuple, Callable] = {}

    def _plain_only(self) -> bool:
        """Whether ``jit_kwargs`` hold more than ``out_shardings`` (e.g. static arguments)."""
        return bool(set(self._jit_kwargs) - {"out_shardings"})

    def __call__(self, *args: Any) -> Any:
        if self._plain_only() or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return self._jit(*args)  # inside a trace: one program, the caller's
        program = self._compiled.get(_signature(args))
        if program is None:
            program = self.lower(*args).compile()
        return program(*args)

    def lower(self, *args: Any) -> _Lowered:
        """The init lowered for ``args`` (arrays or ``jax.ShapeDtypeStruct``)."""
        if self._plain_only():
            return _Lowered(self, None, plain=self._jit.lower(*args))
        key = _signature(args)
        if key[-1]:  # everything compiled at level 0 anyway: one program compiles faster
            return _Lowered(self, key, plain=self._jit.lower(*args))
        closed, out_tree = _flat_jaxpr(self._fn, args)
        plan = _plan(closed)
        if not plan.exports or not plan.b_eqns:
            return _Lowered(self, key, plain=self._jit.lower(*args))
        jaxpr, consts = closed.jaxpr, closed.consts

        def env_of(flat: Sequence[Any]) -> dict:
            env = dict(zip(jaxpr.constvars, consts))
            env.update(zip(jaxpr.invars, flat))
            return env

        def a_fn(*flat: Any) -> tuple:
            results = _eval_groups(env_of(flat), plan.groups)
            return tuple(results[g][pos] for g, pos in plan.exports)

        def b_fn(*flat_and_a: Any) -> Any:
            flat, a_vals = flat_and_a[: len(jaxpr.invars)], flat_and_a[len(jaxpr.invars) :]
            env = env_of(flat)
            for (g, pos), value in zip(plan.exports, a_vals):
                _write_rows(env, plan.groups[g], [pos], [value])
            _eval(env, plan.b_eqns, inline=False)
            outs = [v.val if isinstance(v, jex_core.Literal) else env[v] for v in jaxpr.outvars]
            return jax.tree.unflatten(out_tree, outs)

        # named as the init (B: ``jit(init)``, A: ``jit(init_key_part)``) in JAX's compile logs
        b_fn.__name__ = getattr(self._fn, "__name__", "init")
        a_fn.__name__ = f"{b_fn.__name__}_key_part"
        flat_args = jax.tree.leaves(args)
        a_abs = []
        for g, pos in plan.exports:
            group = plan.groups[g]
            aval = group[0].outvars[pos].aval
            shape = aval.shape if len(group) == 1 else (len(group), *aval.shape)
            a_abs.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
        b_lowered = jax.jit(b_fn, **self._jit_kwargs).lower(*flat_args, *a_abs)

        def lower_a(out_shardings: tuple) -> Any:
            a_jit = jax.jit(a_fn, out_shardings=out_shardings,
                            compiler_options=self._low_options)  # fmt: skip
            return a_jit.lower(*flat_args)

        config = _compile.callers_config() or contextlib.nullcontext
        split = (b_lowered, lower_a, len(flat_args), config)
        return _Lowered(self, key, split=split, key_part=a_fn)


def jit_split_init(
    fn: Callable, low_options: dict[str, Any] | None = None, **jit_kwargs: Any
) -> SplitInit:
    """``jax.jit(fn, **jit_kwargs)`` for a state init: the same bits, a compile several
    times shorter.

    The init's key hashes (threefry: the bulk of XLA:CPU's compile) are compiled at backend
    level 0, where integer arithmetic is as exact as at any other; the rest, all float math
    (uniform, truncated normal, scaling) with it, is compiled with XLA's default options and
    ``jit_kwargs``, as in ``jax.jit(fn)``, from the same bits: the results are
    ``jax.jit(fn, **jit_kwargs)(*args)`` bit for bit. An init with no key hash, or with only
    integer results, or ``jit_kwargs`` other than ``out_shardings``, is one plain ``jax.jit``
    program. Called inside a trace (``jit``, ``shard_map``, ``eval_shape``), it is
    ``jax.jit(fn, **jit_kwargs)``.

    Args:
      fn: the init, e.g. ``model.init``: arrays (a key) in, a pytree of arrays out.
      low_options: the key part's XLA options (default :data:`LOW_OPTIONS`).
      **jit_kwargs: ``jax.jit``'s arguments for the whole init, e.g. ``out_shardings``.

    Returns:
      A callable ``init(*args)`` with ``init.lower(*abstract_args).compile()``: the program
      compiled once per argument signature and kept (a call after ``compile()`` compiles
      nothing).

    Example:
      >>> import jax
      >>> init = jit_split_init(lambda k: jax.random.normal(k, (4, 3)))
      >>> x = init(jax.random.key(0))
      >>> bool((x == jax.jit(lambda k: jax.random.normal(k, (4, 3)))(jax.random.key(0))).all())
      True
    """
    return SplitInit(fn, LOW_OPTIONS if low_options is None else low_options, jit_kwargs)
