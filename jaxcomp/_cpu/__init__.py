r"""The CPU door: everything jaxcomp does only because XLA's CPU backend (XLA:CPU) runs it.

A GPU or TPU user can skip this package: the algorithms above it read the same on every
backend, and what they would do differently on XLA:CPU they ask for here, through
:func:`kernel`. The measurements behind each choice are in ``docs/performance.md``.

**Switched on by the entry points** (host code, before or while a run is built):

* the host allocator: :func:`tune_host_malloc` (glibc ``mallopt``; :mod:`._malloc`), called by
  ``python -m jaxcomp.main``, ``jaxcomp.bench`` and ``jaxcomp.study`` first thing, off unless
  asked (``--host_malloc=keep`` or ``JAXCOMP_HOST_MALLOC=keep``);
* JAX's persistent compilation cache: :func:`refuse_compile_cache` turns it off on XLA:CPU
  (:mod:`._compile_cache`), called by ``python -m jaxcomp.main`` and ``jaxcomp.study`` once the
  backend is known;
* per mesh: :func:`for_mesh` (one BLAS thread when several CPU devices share the process;
  :mod:`._lapack`), called by the step builders (AB-Training's grouped step);
* compile options: :func:`rarely_run_options` (a program run a few times a run compiled at
  backend level 0) and :func:`jit_init` (a state init compiled in two programs,
  :mod:`._init_program`), used by AB-Training's grouped step and the trainer.

**Inside the algorithms**, one hook, :func:`kernel` (``lax.platform_dependent``: chosen when
the program is lowered, so a program exported for GPU or TPU from a CPU machine takes the
portable form), and what is built on it:

* :func:`after`, :func:`computed_once`, :func:`as_written`: ordering and materialising values
  through data dependencies (:mod:`._order`), elsewhere the plain value;
* the sort-free exact top-K (:mod:`._select`, :mod:`._topk_words`) and the matrix-product and
  operand layouts of :mod:`._layouts`, picked by their callers with :func:`kernel`.

**XLA:CPU facts the core is written around** (a comment ``# CPU: jaxcomp._cpu [name]`` marks
the code that depends on one; they are behaviour, not tuning, and are tested where they
matter):

* ``[fma]``: ``c - a * b`` inside a fusion is one fused multiply-add (bit-for-bit references
  allow half an ulp of the product).
* ``[subnormals]``: subnormal inputs and results are flushed to zero, and ``x / s`` is
  ``x * (1 / s)``: a divisor above ``2**126`` gives 0, a prescale ``x * 2**-k`` flushes terms
  below ``2**(k - 126)``.
* ``[nan-max]``: vectorised ``max``/``min`` reductions drop NaN on arrays above a few thousand
  entries; a sum keeps NaN and Inf.
* ``[fusion]``: a cheap elementwise producer is fused into each of its readers and recomputed
  there; ``optimization_barrier`` is expanded before fusion and orders nothing; compile time
  follows the number of distinct fusion kernels (~30 ms each).
* ``[widened-collectives]``: collectives widen ``bfloat16`` and 8-bit float operands (twice the
  bytes, NaN payloads canonicalised): data moves as bits (:mod:`jaxcomp._bits`).
* ``[slow-ops]``: operations XLA:CPU runs several times slower than their plain cost
  (``lax.top_k`` of int32 keys vs float32, ``argmax`` over a short minor axis, a fusion through
  concatenates, a slice that copies, a dot contracting its left operand's first axis, a
  ``lax.switch`` around a whole step): the code takes an equivalent form, said where it is.
* ``[malloc]``: a program's temporaries come from the host ``malloc`` on every call (page
  faults when glibc returns them: :mod:`._malloc`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._cpu import _init_program
from jaxcomp._cpu import _lapack
from jaxcomp._cpu import _order
from jaxcomp._cpu._compile_cache import UNSAFE_CPU_COMPILE_CACHE as UNSAFE_CPU_COMPILE_CACHE
from jaxcomp._cpu._compile_cache import compile_cache_allowed as compile_cache_allowed
from jaxcomp._cpu._compile_cache import refuse_compile_cache as refuse_compile_cache
from jaxcomp._cpu._malloc import HostMalloc as HostMalloc
from jaxcomp._cpu._malloc import tune_host_malloc as tune_host_malloc
from jaxcomp._vma import to_varying
from jaxcomp._vma import varying_axes

#: XLA options of a program a run calls a few times (AB-Training's re-factorisation): XLA:CPU's
#: backend (LLVM) at level 0 compiles it in about half the CPU time, runs it ~10% slower, and
#: gives the same bits. Never for a step that runs every iteration (1.3-1.6x slower).
RARELY_RUN_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


def kernel(*operands: Any, cpu: Callable[..., Any], default: Callable[..., Any]) -> Any:
    """The door's hook: ``cpu(*operands)`` in a program lowered for XLA:CPU, ``default(*operands)``
    for every other backend.

    ``lax.platform_dependent``: the choice is made when the program is lowered, and a program
    lowered for one platform holds only that branch (its compiled HLO is the branch's own).
    Both branches are traced, so they must return the same types, varying axes included
    (inside ``shard_map`` a branch returning a constant needs
    :func:`jaxcomp._vma.to_varying`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jax.jit(lambda x: kernel(x, cpu=lambda x: x + 1, default=lambda x: x - 1))(
      ...     jnp.zeros(2)).tolist()
      [1.0, 1.0]
    """
    return lax.platform_dependent(*operands, cpu=cpu, default=default)


def _deps_axes(deps: Any) -> list[str]:
    leaves = [x for x in jax.tree.leaves(deps) if x.size]
    return sorted(set().union(*map(varying_axes, leaves))) if leaves else []


def after(x: jax.Array, deps: Any) -> jax.Array:
    """``x``, ordered after ``deps`` on XLA:CPU (:func:`._order.after`, a select on a flag read
    from them: a full pass over ``x``); elsewhere ``x`` itself. Either way the values are
    ``x``'s bit for bit, typed as varying over ``deps``' axes too (``[fusion]``).

    Example:
      >>> import jax.numpy as jnp
      >>> after(jnp.array([-0.0, 1.0]), [jnp.ones(2)]).tolist()
      [-0.0, 1.0]
    """
    axes = _deps_axes(deps)
    return kernel(x, cpu=lambda x: _order.after(x, deps), default=lambda x: to_varying(x, axes))


def computed_once(fn: Callable[..., jax.Array], carry: jax.Array, *operands: Any) -> jax.Array:
    """``fn(carry, *operands)``, on XLA:CPU as a step of its own written once into ``carry``'s
    buffer (:func:`._order.computed_once`: not fused into, and recomputed by, each reader);
    elsewhere the plain call (``[fusion]``).

    Example:
      >>> import jax.numpy as jnp
      >>> computed_once(lambda e, x: x + e, jnp.ones(2), jnp.ones(2)).tolist()
      [2.0, 2.0]
    """
    return kernel(
        carry,
        *operands,
        cpu=lambda c, *o: _order.computed_once(fn, c, *o),
        default=lambda c, *o: fn(c, *o),
    )


def as_written(fn: Callable[..., Any], never: Any, operands: tuple, flag_from: Any) -> Any:
    """``fn(*operands)``, on XLA:CPU reading ``operands`` as the program writes them (the true
    branch of a ``lax.cond`` on a flag read from ``flag_from``, always true: a written value is
    not computed a second time inside ``fn``); elsewhere the plain call (``[fusion]``).

    Args:
      fn: the function, e.g. a finiteness check over a program's new state.
      never: what the branch never taken returns (``fn``'s types, varying axes included).
      operands: ``fn``'s arguments.
      flag_from: arrays the flag is read from (non-empty leaves).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(3)
      >>> float(as_written(lambda x: x.sum(), jnp.zeros(()), (x,), [x]))
      3.0
    """

    def cpu(*ops):
        take = _order.after(jnp.ones((), jnp.int32), flag_from) == 1
        return lax.cond(take, fn, lambda *_: never, *ops)

    return kernel(*operands, cpu=cpu, default=fn)


def for_mesh(mesh: jax.sharding.Mesh) -> None:
    """Switches the door on for a step builder's ``mesh``: where this process holds several of
    its devices and all are CPU devices, BLAS (OpenBLAS, LAPACK's kernels) runs one thread per
    call (:func:`._lapack.single_thread_lapack`). Process-wide; elsewhere nothing."""
    if _lapack.many_local_cpu_devices(mesh):
        _lapack.single_thread_lapack()


def rarely_run_options(mesh: jax.sharding.Mesh) -> dict[str, Any] | None:
    """:data:`RARELY_RUN_OPTIONS` for a program on ``mesh``'s devices if they are CPU devices,
    else ``None`` (XLA's defaults). Carry them with the program, so that every compile of it
    builds the same executable."""
    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return dict(RARELY_RUN_OPTIONS)
    return None


def jit_init(fn: Callable, **jit_kwargs: Any) -> Callable:
    """``jax.jit(fn, **jit_kwargs)`` for a state init, compiled on XLA:CPU as two programs
    (:func:`._init_program.jit_split_init`: the same bits, a compile several times shorter)
    when JAX's default backend is the CPU; elsewhere ``jax.jit``."""
    if jax.default_backend() == "cpu":
        return _init_program.jit_split_init(fn, **jit_kwargs)
    return jax.jit(fn, **jit_kwargs)
