"""The trainer's exceptions: what went wrong decides how the CLI reports it.

``SetupError`` is a problem with the input (config, mesh, workdir) found before the first
training step: the CLI prints it as one line. ``NonFiniteError`` and ``Interrupted`` end a run
that has saved its state; ``StorageError`` (a checkpoint or the workdir could not be written)
and ``PeerLost`` (another process is gone) end a run at once, keeping its last good checkpoint.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import signal


class SetupError(ValueError):
    """A bad config, mesh or workdir, found before the first training step (one-line message)."""


class CheckpointError(SetupError):
    """A workdir whose checkpoints exist but none can be restored."""


class WorkdirInUse(SetupError):
    """The workdir is held by another live run (its lock names it)."""


class StorageError(RuntimeError):
    """The workdir or a checkpoint could not be written, or the workdir vanished, during the
    run: the run stops at once, the last good checkpoint kept (one-line message)."""


class PeerLost(RuntimeError):
    """Another process of a multi-process run died, stopped answering or could not be
    reached: this process stops (one-line message naming the process and what happened).

    Attributes:
      exit_code: the CLI's exit status for it (69, ``EX_UNAVAILABLE``); the training loop's
        watchdog, which cannot raise in a thread blocked in a collective, exits with it too.
    """

    exit_code = 69


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
