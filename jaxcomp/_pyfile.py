"""Running a config or study file from its source as it is now.

Python's import machinery reuses a file's cached bytecode while the source's modification time
(whole seconds) and size are unchanged, so a file edited within a second of its last run, to a
text of the same size (``lr = 0.05`` to ``lr = 0.06``), ran as it was before the edit. Config
and study files are compiled from their text every time instead, and leave no ``__pycache__``
beside them.
"""

from __future__ import annotations

import os
import pathlib
import types


def run_file(path: str | os.PathLike, name: str) -> types.ModuleType:
    """Runs the Python file ``path`` as a fresh module named ``name`` and returns it.

    Args:
      path: the file.
      name: the module's ``__name__``.

    Returns:
      The module, its ``__file__`` the path, compiled with the file's own ``__future__``
      imports only; errors raised by the file's code propagate with their traceback through
      it.
    """
    path = pathlib.Path(path)
    module = types.ModuleType(name)
    module.__file__ = str(path)
    exec(compile(path.read_bytes(), str(path), "exec", dont_inherit=True), module.__dict__)
    return module
