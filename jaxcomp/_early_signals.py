"""SIGINT/SIGTERM recorded from the first line of the CLI, before JAX is imported.

Python's default SIGINT handler raises ``KeyboardInterrupt`` at the next bytecode the main
thread runs. While JAX is being imported that is, nearly always, inside JAX's garbage
collector callback (``jax._src.lib._xla_gc_callback``), where an exception is printed as
"Exception ignored" and dropped: a Ctrl-C in the first 2.2 s of ``python -m jaxcomp.main``
was ignored in 8 of 9 tries and the run trained to its end (exit 0). A handler that only
records the signal cannot lose it; the CLI (:mod:`jaxcomp.main`) reads it between its startup
phases and the trainer's :class:`jaxcomp.train.StopOnSignal` takes it over.

Importing this module (``jaxcomp/__init__.py`` does, first) installs the handler only when
the process was started as ``python -m jaxcomp.main`` (:func:`install_for_the_cli`);
importing jaxcomp from a program changes no signal handling. It imports only the standard
library.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CLI = "jaxcomp.main"


class EarlySignals:
    """A handler for SIGINT/SIGTERM that records the first signal (:attr:`signum`); a second
    one raises ``KeyboardInterrupt`` (stop at once).

    Example:
      >>> early = EarlySignals().install()
      >>> early.signum is None
      True
      >>> early.restore()
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> EarlySignals:
        """Becomes the handler (main thread only; elsewhere Python cannot install one)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self)
        return self

    def __call__(self, signum: int, frame) -> None:
        del frame
        if self.signum is None:
            self.signum = signum
            return
        raise KeyboardInterrupt

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}


def started_as_the_cli(argv: Sequence[str]) -> bool:
    """Whether the interpreter's command line (``sys.orig_argv``) runs ``-m jaxcomp.main``."""
    argv = list(argv)
    return any(a == "-m" and b == CLI for a, b in zip(argv, argv[1:])) or any(
        a == f"-m{CLI}" for a in argv
    )


def install_for_the_cli(argv: Sequence[str]) -> None:
    """Installs an :class:`EarlySignals` when ``argv`` starts the CLI (else does nothing)."""
    if started_as_the_cli(argv) and not isinstance(signal.getsignal(signal.SIGINT), EarlySignals):
        EarlySignals().install()


def current() -> EarlySignals | None:
    """The installed :class:`EarlySignals`, if SIGINT's handler is one."""
    handler = signal.getsignal(signal.SIGINT)
    return handler if isinstance(handler, EarlySignals) else None


install_for_the_cli(getattr(sys, "orig_argv", ()))
