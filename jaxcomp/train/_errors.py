"""The trainer's exceptions: what went wrong decides how the CLI reports it.

``SetupError`` is a problem with the input (config, mesh, workdir) found before the first
training step: the CLI prints it as one line. ``NonFiniteError`` and ``Interrupted`` end a run
that has saved its state. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import signal


class SetupError(ValueError):
    """A bad config, mesh or workdir, found before the first training step (one-line message)."""


class CheckpointError(SetupError):
    """A workdir whose checkpoints exist but none can be restored."""


class NonFiniteError(RuntimeError):
    """Raised when too many training steps in a row had a non-finite loss, gradient or state."""


class Interrupted(KeyboardInterrupt):
    """The run stopped on SIGTERM/SIGINT after finishing a step and saving a checkpoint.

    A ``KeyboardInterrupt`` (not an ``Exception``), so that code catching ``Exception`` (a
    sweep going on to its next run) does not swallow a preemption: the program stops.

    Attributes:
      signum: the signal that stopped the run.
      step: the last finished (and checkpointed) step.
    """

    def __init__(self, signum: int, step: int, message: str):
        super().__init__(message)
        self.signum, self.step = signum, step


class Aborted(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: stop at once, without saving (the last finished checkpoint is
    kept; a half-written one is ignored on the next start).

    Attributes:
      signum: the second signal.
    """

    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__(f"aborted by a second signal ({name}) without saving.")
        self.signum = signum


@contextlib.contextmanager
def setup_phase():
    """Re-raises a ``ValueError`` from the enclosed setup code as a :class:`SetupError`."""
    try:
        yield
    except SetupError:
        raise
    except ValueError as e:
        raise SetupError(str(e)) from e
