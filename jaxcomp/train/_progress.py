"""Progress output: a one-line bar on a terminal, periodic lines otherwise; the programs being
compiled during setup."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping


def _duration(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Prints ``step/total [bar] loss acc bytes/step steps/s ETA``.

    Args:
      total: the last step.
      start: the step the run starts (or resumes) at.
      enabled: print at all (only process 0 prints).
      stream: where to print (default ``sys.stdout``).
    """

    def __init__(self, total: int, start: int = 0, enabled: bool = True, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.t_last = self.t0

    def update(self, step: int, scalars: Mapping[str, float], final: bool = False) -> str:
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        rate = done / elapsed if elapsed > 0 and done > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else 0.0
        width = 20
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        parts = [f"step {step:>{len(str(self.total))}d}/{self.total} [{bar}]"]
        for key, fmt in (("loss", "loss {:.4f}"), ("accuracy", "acc {:.3f}")):
            if key in scalars:
                parts.append(fmt.format(float(scalars[key])))
        if "wire_bytes" in scalars:
            from jaxcomp.train._metrics import format_bytes

            parts.append(f"{format_bytes(scalars['wire_bytes'])}/step")
        if scalars.get("nonfinite_steps"):
            parts.append(f"skipped {int(scalars['nonfinite_steps'])}")
        parts.append(f"{rate:.1f} it/s ETA {_duration(eta)}")
        line = " | ".join(parts)
        if self.enabled:
            if self.tty and not final:
                self.stream.write("\r" + line)
            else:
                self.stream.write(("\r" if self.tty else "") + line + "\n")
            self.stream.flush()
        return line

    def message(self, text: str) -> None:
        if self.enabled:
            self.stream.write(("\n" if self.tty else "") + text + "\n")
            self.stream.flush()


class _Say(logging.Handler):
    def __init__(self, say: Callable[[str], None], t0: float):
        super().__init__(logging.INFO)
        self.say, self.t0 = say, t0

    def emit(self, record: logging.LogRecord) -> None:
        self.say(f"  {record.getMessage()} ({time.perf_counter() - self.t0:.1f} s)")


@contextlib.contextmanager
def compiles_announced(say: Callable[[str], None]) -> Iterator[None]:
    """Prints ``  compiling NAME (T s)`` as each program's compile starts inside the block
    (:func:`jaxcomp._compile.compile_all` logs them), ``T`` the seconds since the block began:
    a user sees what the setup is doing before its first step."""
    logger = logging.getLogger("jaxcomp._compile")
    handler = _Say(say, time.perf_counter())
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
