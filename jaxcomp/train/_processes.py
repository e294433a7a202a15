"""What the processes of a multi-process run decide together: one answer for every process.

A decision taken on one process (the workdir's lock, a stop request, a failed save, a
checkpoint found damaged) must be the same on every process, or one process enters a
collective that the others never join and the run hangs. Each helper is one small collective
of host values (``multihost_utils``) and costs nothing in a single process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence

import jax
import numpy as np

from jaxcomp.train import _errors

_TEXT_BYTES = 1024  #: the longest text one process tells the others (UTF-8, cut there)


def gather_ints(values: Sequence[int]) -> np.ndarray:
    """Every process's ``values``: an ``int32`` array ``[process, len(values)]``.

    Example:
      >>> gather_ints([3, 0]).tolist()  # one process
      [[3, 0]]
    """
    local = np.asarray(values, np.int32).reshape(1, -1)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    out = multihost_utils.process_allgather(local.reshape(-1))
    return np.asarray(out, np.int32).reshape(jax.process_count(), -1)


def text_of_process_0(text: str) -> str:
    """Process 0's ``text`` on every process (``""`` for none; cut to 1 KiB of UTF-8).

    Example:
      >>> text_of_process_0("workdir in use")  # one process
      'workdir in use'
    """
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = np.zeros(_TEXT_BYTES, np.uint8)
    raw = text.encode()[:_TEXT_BYTES]
    data[: len(raw)] = np.frombuffer(raw, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8)
    return bytes(got).rstrip(b"\0").decode(errors="replace")


#: what the errors of a collective or of JAX's coordination service say when another process
#: died, stopped or cannot be reached (gloo on CPU; the coordination service everywhere)
_PEER_FAILURE = (
    "connection reset by peer",
    "connection closed by peer",
    "connection refused",
    "broken pipe",
    "gloo",
    "barrier failed",
    "heartbeat timeout",
    "task is set to error",
    "unavailable:",
    "deadline_exceeded",
    "coordination service",
)


def is_peer_failure(error: BaseException, processes: int | None = None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a failed collective or
    coordination call of a multi-process run, i.e. another process is gone, not a fault of
    the data at hand (a checkpoint read back through such a call is not damaged).

    Args:
      error: the error.
      processes: the run's process count (default ``jax.process_count()``); with one
        process nothing is a peer's failure.
    """
    if (jax.process_count() if processes is None else processes) == 1:
        return False
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error).lower()
        if any(p in text for p in _PEER_FAILURE):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:240] if text else ''}"


@contextlib.contextmanager
def peer_failures_as_lost(name_lost: Callable[[], str] | None = None):
    """Turns an error of a failed collective (another process is gone) into
    :class:`~jaxcomp.train.PeerLost` with one line; other errors pass as they are.

    Args:
      name_lost: returns who is gone and how (e.g. ``"process 1 (pid 12 on host h) exited"``),
        when the run can tell; by default "another process".
    """
    try:
        yield
    except _errors.PeerLost as e:  # raised where the failure was met: name the process too
        if name_lost is None:
            raise
        raise _errors.PeerLost(f"{name_lost()}: {e}") from e
    except Exception as e:
        if not is_peer_failure(e):
            raise
        who = name_lost() if name_lost is not None else "another process of the run is gone"
        raise _errors.PeerLost(f"{who}: a collective failed ({first_line(e)})") from e
