"""JAX's persistent compilation cache, refused on XLA:CPU.

A data-parallel Accordion step of the GPT (8 CPU devices, TopK on both levels) loaded from the
persistent cache trained differently from the same program compiled fresh: the same first
step, then other losses from the second on, non-finite steps and a collective deadlock, and
another outcome on each rerun with the same cache (nondeterministic; a fresh compile is
identical run to run). The reproduction and what is known of the cause are in
``docs/results/accbug/``. Until the cause is found, the entry points (the trainer's CLI, the
study CLI) turn the cache off on CPU with one line saying so; ``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1``
keeps it on for a user who accepts the risk.
"""

from __future__ import annotations

import os

import jax

#: Environment switch that keeps the persistent cache on XLA:CPU (at the user's risk).
UNSAFE_CPU_COMPILE_CACHE = "JAXCOMP_UNSAFE_CPU_COMPILE_CACHE"


def compile_cache_allowed(platform: str) -> bool:
    """Whether the persistent cache may be used for ``platform``: not on ``"cpu"`` unless
    ``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1``."""
    return platform != "cpu" or os.environ.get(UNSAFE_CPU_COMPILE_CACHE) == "1"


def refuse_compile_cache(platform: str) -> str | None:
    """Turns JAX's persistent compilation cache off when ``platform`` is ``"cpu"``.

    Call before the first compile (JAX decides once per process whether to use the cache).

    Args:
      platform: the backend the run compiles for (``jax.default_backend()``).

    Returns:
      The one-line reason when a configured cache was turned off, else ``None`` (no cache
      directory set, another backend, or ``JAXCOMP_UNSAFE_CPU_COMPILE_CACHE=1``).
    """
    path = jax.config.jax_compilation_cache_dir
    if compile_cache_allowed(platform) or not path or not jax.config.jax_enable_compilation_cache:
        return None
    jax.config.update("jax_enable_compilation_cache", False)
    return (
        f"the persistent compilation cache ({path}) is off on CPU: a cached multi-device XLA:CPU "
        "program was found to compute differently from a fresh compile (docs/results/accbug); "
        f"{UNSAFE_CPU_COMPILE_CACHE}=1 keeps it on at your own risk"
    )
