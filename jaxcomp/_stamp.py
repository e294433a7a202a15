"""What produced a result: the commit, the versions, the machine's size and the date.

Written beside every number that is meant to reproduce (a study cell's record,
``docs/results/headline/headline.json``), so a rerun elsewhere can tell a changed library from
a changed result.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import subprocess
from typing import Any


def _git(root: pathlib.Path, *args: str) -> str | None:
    try:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 else None


def stamp() -> dict[str, Any]:
    """``{"jaxcomp", "commit", "dirty", "jax", "jaxlib", "python", "cpus", "date"}``.

    ``commit`` is the ``HEAD`` of the source checkout the package was imported from and
    ``dirty`` whether tracked files differ from it (both ``None`` for an installed wheel).
    """
    import jax
    import jaxlib

    import jaxcomp

    root = pathlib.Path(jaxcomp.__file__).resolve().parents[1]
    checkout = (root / ".git").exists()
    commit = _git(root, "rev-parse", "HEAD") if checkout else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if checkout else None
    return {
        "jaxcomp": jaxcomp.__version__,
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }


def describe(s: dict[str, Any]) -> str:
    """A stamp in one line, e.g. ``commit 1a2b3c4 (jax 0.10.2, jaxlib 0.10.2, Python 3.11.7,
    2 CPUs), 2026-12-05``."""
    commit = (s.get("commit") or "unknown")[:7] + (" with local changes" if s.get("dirty") else "")
    return (
        f"commit {commit} (jax {s.get('jax')}, jaxlib {s.get('jaxlib')}, Python "
        f"{s.get('python')}, {s.get('cpus')} CPUs), {s.get('date')}"
    )
