"""What jaxcomp reads of JAX's private modules (``jax._src``), in this one place.

Each use has a fallback, so a JAX release that moves one of them costs a feature, not a
crash; ``tests/_cpu/test_door.py`` checks that every one is still where it is read from,
so the fallback is never taken unnoticed:

* :func:`config_states`: the configuration's states and the value meaning "not set in a
  ``with`` block" (:func:`jaxcomp._compile.callers_config` re-enters the caller's values in a
  compile thread; fallback: compile in the caller's thread);
* :func:`summarize_source`: an equation's source line for an error message
  (:mod:`jaxcomp.comm._uniformity`; fallback: ``"<unknown location>"``);
* :func:`distributed_client`: the coordination service's client of a multi-process run
  (:mod:`jaxcomp.train._watchdog` names a lost peer with it; fallback: the peer unnamed).
"""

from __future__ import annotations

from typing import Any


def config_states() -> tuple[list[Any], Any]:
    """``(states, unset)``: every JAX configuration state (each with ``get_local()`` and usable
    as ``with state(value):``) and the value ``get_local()`` gives when no ``with`` block set
    it.

    Raises:
      ImportError or AttributeError: where this JAX keeps them elsewhere.
    """
    from jax._src import config as jax_config

    return list(jax_config.config_states.values()), jax_config.config_ext.unset


def summarize_source(source_info: Any) -> str:
    """``file:line (function)`` of a jaxpr equation's ``source_info``.

    Raises:
      ImportError or AttributeError: where this JAX keeps it elsewhere.
    """
    from jax._src import source_info_util

    return source_info_util.summarize(source_info)


def distributed_client() -> Any:
    """JAX's coordination-service client of this process (``None`` before
    ``jax.distributed.initialize``).

    Raises:
      ImportError or AttributeError: where this JAX keeps it elsewhere.
    """
    from jax._src import distributed

    return distributed.global_state.client
