"""Graceful stop on SIGTERM / SIGINT: finish the step, checkpoint, exit; a second signal aborts.

Preemption on clusters is a SIGTERM, and Ctrl-C is a SIGINT. Inside :class:`StopOnSignal` the
first of either only sets a flag that the training loop reads after each step; a second one
raises :class:`~jaxcomp.train.Aborted` at once. With several processes the flag is agreed over
all of them (any process signalled stops every process after the same step), so no process is
left waiting in a collective. In a block with nothing to save (compiling the run's programs)
a single process stops at once instead (:meth:`StopOnSignal.at_once`).
"""

from __future__ import annotations

import contextlib
import gc
import signal
import threading

import jax
import numpy as np

from jaxcomp.train import _processes
from jaxcomp.train._errors import Aborted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(KeyboardInterrupt):
    """A first signal inside :meth:`StopOnSignal.at_once`: leave the block now (the caller
    turns it into :class:`~jaxcomp.train.Interrupted`)."""


class StopOnSignal:
    """A context manager that turns SIGTERM/SIGINT into a stop request.

    Handlers are installed only in the main thread (elsewhere Python cannot install them and
    signals keep their previous behaviour); the previous handlers come back on exit.

    Example:
      >>> with StopOnSignal() as stop:
      ...     for step in range(3):
      ...         if stop.should_stop():
      ...             break
      >>> stop.signum is None
      True
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._at_once = False

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
                # a signal that a handler of the caller recorded (the CLI's, from its first
                # line) counts as received here
                early = getattr(self._previous[s], "signum", None)
                if self.signum is None and early is not None:
                    self.signum = early
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum  # no printing here: the main thread may be mid-print
            # where Python would print StopNow and drop it, the block's end raises it
            if self._at_once and not _dropping(frame):
                raise StopNow
            return
        self._restore()
        raise Aborted(signum)

    @contextlib.contextmanager
    def at_once(self):
        """A block that a first signal ends at once with :class:`StopNow` (raised where the
        main thread is: between two bytecodes, or when a wait such as a compile's result
        returns), for work with nothing to save, such as compiling the run's programs; a
        signal handled in a garbage-collector callback or a ``__del__`` (where Python would
        print the exception and drop it) ends the block at its end instead. In a single
        process only: with several, the others would wait for this one in their next
        collective, so the signal stays a flag agreed after the block.

        Raises:
          StopNow: on a signal received in the block, or before it (recorded, not agreed).
        """
        if jax.process_count() > 1 or not self._previous:
            yield
            return
        if self.signum is not None:
            raise StopNow
        self._at_once = True
        try:
            yield
        finally:
            self._at_once = False
        if self.signum is not None:  # received in the block where it could not be raised
            raise StopNow

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def should_stop(self) -> bool:
        """Whether a signal asked this process (or, with several processes, any) to stop."""
        self.agree()
        return self.signum is not None

    def agree(self, fault: int = 0) -> np.ndarray:
        """Agrees on a stop over all processes, with each process's ``fault`` code.

        One collective carries both: a signal received by any process stops every process
        after the same step (:attr:`signum` is set from another process's signal), and the
        codes let every process stop together when one of them cannot go on.

        Args:
          fault: this process's code (0: nothing wrong).

        Returns:
          Every process's fault code, by process index.
        """
        codes = _processes.gather_ints([self.signum or 0, fault])
        signums = codes[:, 0]
        if self.signum is None and signums.max() > 0:  # another process was signalled
            self.signum = int(signums[signums > 0][0])
        return codes[:, 1]


def _dropping(frame) -> bool:
    """Whether an exception raised in ``frame`` would be printed and dropped by Python: the
    frame runs (or is called from) a garbage-collector callback or a ``__del__``."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False
