"""Optional packages a config needs, checked before a run creates anything.

A config that needs an extra that is not installed (``tfds_images`` without ``jaxcomp[data]``,
``writers=("tensorboard",)`` without ``jaxcomp[tensorboard]``) is a one-line error naming the
extra, raised by :func:`jaxcomp.train.with_defaults`, before the workdir exists.
"""

from __future__ import annotations

import importlib.util

#: ``config.data_name`` -> (the module it needs, the jaxcomp extra that installs it)
DATASETS = {
    "tfds_images": ("tensorflow_datasets", "data"),
    "tfds_text": ("tensorflow_datasets", "data"),
}


def require(module: str, extra: str, what: str) -> None:
    """Raises ``ValueError`` (one line: ``what`` needs ``module``: ``pip install
    'jaxcomp[extra]'``) when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(
            f"{what} needs the {module} package, which is not installed: "
            f"pip install 'jaxcomp[{extra}]'."
        )


def check_data(data_name: str) -> None:
    """The extra of ``config.data_name`` is installed (``ValueError`` naming it otherwise)."""
    if data_name in DATASETS:
        module, extra = DATASETS[data_name]
        require(module, extra, f"config.data_name={data_name!r}")
