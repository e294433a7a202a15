"""Where the experiment configs are: in an installed wheel, or in a source checkout.

The top-level ``configs/`` of the repository is their source; a wheel ships the same files as
``jaxcomp/configs`` (``setup.py`` maps that package to ``configs/``), so ``python -m
jaxcomp.main --config digits_pipeline`` works without a checkout.
"""

from __future__ import annotations

import pathlib


def configs_dir() -> pathlib.Path:
    """The experiment configs: ``jaxcomp/configs`` of an installed wheel, else ``configs/``
    beside the ``jaxcomp`` package (a source checkout or an editable install), else
    ``./configs``."""
    package = pathlib.Path(__file__).resolve().parent
    for candidate in (package / "configs", package.parent / "configs"):
        if candidate.is_dir():
            return candidate
    return pathlib.Path.cwd() / "configs"


def config_names() -> list[str]:
    """The names of the experiment configs (``digits_pipeline``, ...)."""
    folder = configs_dir()
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))
