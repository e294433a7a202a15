"""Command-line entry points stop quietly when their reader goes away (``... | head``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

#: The exit status of a process that ``SIGPIPE`` ended (Python ignores the signal and raises
#: ``BrokenPipeError`` instead; a CLI answers as the shell's own tools do).
EXIT_BROKEN_PIPE = 128 + 13


def run_cli(main: Callable[..., int], *args, **kwargs) -> int:
    """``main(*args, **kwargs)``; a ``BrokenPipeError`` ends it with :data:`EXIT_BROKEN_PIPE`.

    Standard output is pointed at ``/dev/null`` first, so the interpreter's flush at exit
    does not raise again (the recipe of Python's ``signal`` documentation).
    """
    try:
        return main(*args, **kwargs)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
