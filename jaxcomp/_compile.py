"""Compiling several lowered programs at once, before anything runs.

Lowering (tracing a function to a module) holds Python's GIL, XLA's compilation does not: so
programs lowered one after another compile side by side in threads. XLA:CPU already spreads
one compile over part of a second core (1.6 of 2 cores on average for the trainer's
programs); side by side they fill the cores: on 2 idle cores the digits AB mode's setup (three
step programs, init, evaluation) took 6.97 s instead of 7.77 s, the dense mode's 4.41 s
instead of 4.72 s (medians of 6 alternated rounds in one process, 2026-12-02). More cores
should gain more (not measured here).

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

#: logs each program's name (INFO) as :func:`compile_all` starts lowering and compiling it;
#: the trainer prints these lines during its setup
log = logging.getLogger(__name__)


def callers_config() -> Callable[[], contextlib.AbstractContextManager] | None:
    """A context that re-enters, in another thread, the JAX configuration values the calling
    thread holds in ``with`` blocks; ``None`` when JAX's configuration cannot be read so
    (its ``config_states`` registry is private: the caller then compiles in its own thread)."""
    try:
        from jax._src import config as jax_config

        unset = jax_config.config_ext.unset
        local = [(s, s.get_local()) for s in jax_config.config_states.values()]
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
    holding it). On 2 idle cores the digits AB mode's setup (three step programs lowered in
    0.7 s, each compile 0.6-0.8 s) took 0.3 s less so (3 alternated rounds).

    Args:
      lowered: ``jax.stages.Lowered`` programs (``jax.jit(f).lower(...)``), or functions
        returning one, by name; compiled side by side in up to one thread per core (at least
        two).

    Returns:
      The ``jax.stages.Compiled`` programs, by name, in ``lowered``'s order.

    Raises:
      The error of a program that failed to lower, at once (after the compiles already
      started end), with a note naming it; else the error of the first program (in
      ``lowered``'s order) whose compilation failed, once every compilation has ended, with a
      note naming the program and any other that failed.

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
        with ThreadPoolExecutor(threads, thread_name_prefix="jaxcomp-compile") as pool:
            futures = []
            try:
                for name in names:
                    futures.append(pool.submit(compile_one, lower(name)))
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
            results = [f.result() for f in futures]
    failed = [(name, error) for name, (_, error) in zip(names, results) if error is not None]
    if failed:
        (name, error), others = failed[0], [n for n, _ in failed[1:]]
        error.add_note(f"(while compiling the program {name!r})")
        if others:
            error.add_note(f"(the compilation of {others} failed too)")
        raise error
    return {name: compiled for name, (compiled, _) in zip(names, results)}


#: XLA options for a program a run calls a few times: XLA:CPU's backend (LLVM) at level 0
#: compiles the AB re-factorisation (SVDs in LAPACK, a few matrix products) in 0.6 s of CPU
#: instead of 1.1 s, and it runs in 78 ms instead of 71 ms (digits MLP, 2 idle cores).
RARELY_RUN_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}


class WithOptions:
    """A ``jax.stages.Lowered`` program whose ``compile()`` passes XLA ``options``
    (e.g. :data:`RARELY_RUN_OPTIONS`); every other attribute is the lowered program's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> low = WithOptions(jax.jit(jnp.sin).lower(jnp.zeros(3)), RARELY_RUN_OPTIONS)
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
