"""Compiling several lowered programs at once, before anything runs.

Lowering (tracing a function to a module) holds Python's GIL, XLA's compilation does not: so
programs lowered one after another compile side by side in threads, filling cores one
compile leaves partly idle (the trainer's setups: ``docs/performance.md``).

The executables are the ones ``lowered.compile()`` returns one by one (the same module and
options): JAX reads some compile options from its configuration at compile time, and a value
the caller set in a ``with`` block (``jax.log_compiles(True)``, an optimisation-effort state)
is local to the caller's thread, so each worker thread enters the caller's thread-local values
before it compiles. Call it only while no multi-device program runs: on CPU, the device
threads of a running step starve beside a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxcomp import _jax_private

#: logs each program's name (INFO) as :func:`compile_all` starts lowering and compiling it;
#: the trainer prints these lines during its setup
log = logging.getLogger(__name__)


def callers_config() -> Callable[[], contextlib.AbstractContextManager] | None:
    """A context that re-enters, in another thread, the JAX configuration values the calling
    thread holds in ``with`` blocks; ``None`` when JAX's configuration cannot be read so
    (its ``config_states`` registry is private, :func:`jaxcomp._jax_private.config_states`: the
    caller then compiles in its own thread)."""
    try:
        states, unset = _jax_private.config_states()
        local = [(s, s.get_local()) for s in states]
    except (ImportError, AttributeError):
        return None
    local = [(state, value) for state, value in local if value is not unset]

    def enter() -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for state, value in local:
            stack.enter_context(state(value))
        return stack

    return enter


def lower_later(jitted: Any, *args: Any, mesh: Any = None) -> Callable[[], Any]:
    """A function lowering ``jitted`` for ``args`` (inside ``jax.set_mesh(mesh)`` when a mesh
    is given): a program for :func:`compile_all` to lower when it reaches it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> out = compile_all({"sin": lower_later(jax.jit(jnp.sin), jnp.zeros(2))})
      >>> out["sin"](jnp.zeros(2)).tolist()
      [0.0, 0.0]
    """

    def lower() -> Any:
        import jax

        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            return jitted.lower(*args)

    return lower


def compile_all(lowered: Mapping[str, Any]) -> dict[str, Any]:
    """Compiles programs concurrently: ``{name: lowered[name].compile()}``.

    A value may also be a function of no arguments that lowers its program
    (``lambda: jax.jit(f).lower(x)``): those are lowered here, in order, in the calling
    thread, and each compile starts as soon as its program is lowered, so lowering the next
    program (Python, holding the GIL) runs beside the compiles of those before it (XLA, not
    holding it).

    Args:
      lowered: ``jax.stages.Lowered`` programs (``jax.jit(f).lower(...)``), or functions
        returning one, by name; compiled side by side in up to one thread per core (at least
        two).

    Returns:
      The ``jax.stages.Compiled`` programs, by name, in ``lowered``'s order.

    Raises:
      The error of a program that failed to lower (with a note naming it), or an interrupt,
      at once: the compiles already started are not waited for; else the error of the first
      program (in ``lowered``'s order) whose compilation failed, once every compilation has
      ended, with a note naming the program and any other that failed.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda x: x + 1)
      >>> out = compile_all({"inc": f.lower(jnp.zeros(3)), "inc2": lambda: f.lower(jnp.zeros(2))})
      >>> out["inc"](jnp.zeros(3)).tolist()
      [1.0, 1.0, 1.0]
    """
    names = list(lowered)
    config = callers_config()

    def lower(name: str) -> Any:
        log.info("compiling %s", name)
        program = lowered[name]
        if hasattr(program, "compile"):
            return program
        try:
            return program()
        except Exception as e:
            e.add_note(f"(while lowering the program {name!r})")
            raise

    def compile_one(program: Any, in_thread: bool = True) -> tuple[Any, BaseException | None]:
        try:
            with config() if in_thread else contextlib.nullcontext():
                return program.compile(), None
        except Exception as e:  # noqa: BLE001 - re-raised below, named
            return None, e

    if len(names) <= 1 or config is None:
        results = [compile_one(lower(n), in_thread=False) for n in names]
    else:
        threads = min(len(names), max(os.cpu_count() or 1, 2))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxcomp-compile")
        futures = []
        try:
            for name in names:
                futures.append(pool.submit(compile_one, lower(name)))
            results = [f.result() for f in futures]
        except BaseException:
            # an error lowering, or an interrupt (KeyboardInterrupt): the compiles under way
            # are not waited for (their results are dropped), those not started never start
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    failed = [(name, error) for name, (_, error) in zip(names, results) if error is not None]
    if failed:
        (name, error), others = failed[0], [n for n, _ in failed[1:]]
        error.add_note(f"(while compiling the program {name!r})")
        if others:
            error.add_note(f"(the compilation of {others} failed too)")
        raise error
    return {name: compiled for name, (compiled, _) in zip(names, results)}


class WithOptions:
    """A ``jax.stages.Lowered`` program whose ``compile()`` passes XLA ``options``
    (e.g. :data:`jaxcomp._cpu.RARELY_RUN_OPTIONS`); every other attribute is the lowered
    program's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> options = {"xla_backend_optimization_level": 0}
      >>> low = WithOptions(jax.jit(jnp.sin).lower(jnp.zeros(3)), options)
      >>> low.compile()(jnp.zeros(3)).tolist()
      [0.0, 0.0, 0.0]
    """

    def __init__(self, lowered: Any, options: Mapping[str, Any]):
        self.lowered, self.options = lowered, dict(options)

    def compile(self) -> Any:
        return self.lowered.compile(dict(self.options))

    def __getattr__(self, name: str) -> Any:
        if name == "lowered":  # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.lowered, name)
