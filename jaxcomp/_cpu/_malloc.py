"""Keeps the host's freed memory for reuse: glibc ``mallopt`` settings for CPU-backend jobs.

XLA's CPU backend allocates a compiled program's temporaries and outputs from the host ``malloc``
on every call and frees them afterwards. glibc serves blocks above its mmap threshold (dynamic,
128 KiB up to 32 MiB) with a fresh ``mmap`` and gives freed memory at the top of a heap back to
the kernel past its trim threshold; either way the next call touches new pages, one minor page
fault per 4 KiB: error feedback around TopK once cost a data-parallel step more for that
reason than for its arithmetic (``docs/performance.md``).

:func:`tune_host_malloc` asks glibc to serve every block from one heap and never to return
freed memory to the kernel, so the pages stay mapped and the next call reuses them:

* ``M_ARENA_MAX = 1``: one arena for every thread (XLA's worker threads otherwise get arenas
  of their own, each trimmed on its own);
* ``M_MMAP_MAX = 0``: no block is served by its own ``mmap`` (``M_MMAP_THRESHOLD`` cannot be
  raised past 32 MiB with ``mallopt``, and a program's temporaries can be larger);
* ``M_TRIM_THRESHOLD = 2**31 - 1`` (the largest ``mallopt`` takes): the heap's free top is
  returned to the kernel only past 2 GiB.

The cost: the process's resident memory stays at its high-water mark, and with one arena
XLA:CPU's device threads share one lock: the digits trainer (8 device threads on 2 cores) ran
slower with it. Since the
temporaries of the TopK error-feedback programs were brought under 32 MiB they fault little
without it, so the entry points (``python -m jaxcomp.main``, ``python -m jaxcomp.bench``,
``python -m jaxcomp.study``) keep glibc's defaults unless asked (``--host_malloc=keep`` or
``JAXCOMP_HOST_MALLOC=keep``); a CPU job whose programs have temporaries above 32 MiB per
device (``compiled.memory_analysis().temp_size_in_bytes``) may gain from it. It is a
process-wide setting, so the library never applies it by itself: call it first thing, before
JAX starts its backend. Arenas that threads already own stay; blocks already mapped are
unmapped when freed as before. It does nothing where the C library is not glibc (macOS, musl)
and reports so.

The same, set from outside the process (before it starts)::

  MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 python ...

Without ``M_ARENA_MAX = 1`` (the other two settings only, so no shared lock) the faults come
back, likely because a thread arena's extra heap is unmapped once it is empty, whatever the
trim threshold (``docs/performance.md``).
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import NamedTuple

ENV = "JAXCOMP_HOST_MALLOC"
CHOICES = ("keep", "default")
# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, "M_ARENA_MAX", 1), (M_MMAP_MAX, "M_MMAP_MAX", 0),
            (M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", 2**31 - 1))  # fmt: skip


class HostMalloc(NamedTuple):
    """What :func:`tune_host_malloc` did.

    Attributes:
      applied: whether glibc accepted every setting.
      reason: why not, or the settings applied (``"M_ARENA_MAX=1, ..."``).
    """

    applied: bool
    reason: str


def tune_host_malloc(choice: str | None = "keep") -> HostMalloc:
    """Keeps freed host memory mapped for reuse (glibc only; see the module docstring).

    Args:
      choice: ``"keep"`` (apply) or ``"default"`` (leave glibc's defaults); ``None`` reads
        the ``JAXCOMP_HOST_MALLOC`` environment variable (unset: ``"default"``), as the
        command-line entry points do.

    Returns:
      A :class:`HostMalloc` saying whether the settings were applied, and why not.

    Raises:
      ValueError: for a ``choice`` (or environment value) other than ``"keep"``/``"default"``.

    Example:
      >>> from jaxcomp import _cpu
      >>> _cpu.tune_host_malloc("default").applied
      False
    """
    source = "choice"
    if choice is None:
        choice, source = os.environ.get(ENV, "default"), f"${ENV}"
    if choice not in CHOICES:
        raise ValueError(f"{source} must be one of {CHOICES}; got {choice!r}.")
    if choice == "default":
        return HostMalloc(False, f"{source}={choice}: glibc's defaults kept")
    libc, version = platform.libc_ver()
    if libc != "glibc":
        return HostMalloc(False, f"the C library is not glibc ({libc or 'unknown'})")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError) as e:  # a static or odd build
        return HostMalloc(False, f"glibc {version} without a callable mallopt: {e}")
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    refused = []
    for param, name, value in SETTINGS:
        if mallopt(param, value) != 1:
            refused.append(name)
    if refused:
        return HostMalloc(False, f"glibc {version} refused {', '.join(refused)}")
    text = ", ".join(f"{name}={value}" for _, name, value in SETTINGS)
    return HostMalloc(True, text)
