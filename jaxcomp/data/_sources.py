"""Random-access data sources: in-memory arrays, scikit-learn's bundled digits and synthetic
images (the text that ships with Python: :mod:`jaxcomp.data._text`).

A *source* is anything with ``len(source)`` and ``source.__getitems__(indices) -> dict`` of
numpy arrays stacked along a leading axis (the protocol of ``tfds.data_source``). The loader
adds the sample ids.
"""

from __future__ import annotations

import gzip
import importlib.util
import pathlib
import warnings
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol

import numpy as np

from jaxcomp import _validate

SPLITS = ("train", "test")


class Source(Protocol):
    """Random access to examples: ``len`` and ``__getitems__`` returning stacked arrays."""

    def __len__(self) -> int: ...

    def __getitems__(self, indices: Sequence[int]) -> dict[str, np.ndarray]: ...


class ArraySource:
    """A source over a dict of equally long numpy arrays.

    Example:
      >>> src = ArraySource({"x": np.zeros((5, 2)), "label": np.arange(5)})
      >>> src.__getitems__([4, 0])["label"]
      array([4, 0])
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        num_classes: int | None = None,
        info: Mapping[str, Any] | None = None,
    ):
        lengths = {k: len(v) for k, v in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"all arrays must have the same length; got {lengths}.")
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        self._len = next(iter(lengths.values()))
        #: classes of ``label`` (the vocabulary for token labels); ``None`` if not declared
        self.num_classes = num_classes
        #: what the data are (a text corpus's identity, its reference perplexity), JSON-able;
        #: the trainer writes it into the run's summary
        self.info = dict(info) if info is not None else None

    def __len__(self) -> int:
        return self._len

    def __getitems__(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        idx = np.asarray(indices, np.int64)
        return {k: v[idx] for k, v in self.arrays.items()}

    def __repr__(self) -> str:
        shapes = {k: (v.shape, str(v.dtype)) for k, v in self.arrays.items()}
        return f"ArraySource(len={self._len}, {shapes})"


#: rows and columns (64 pixels, then the label) of scikit-learn's ``digits.csv.gz``
_DIGITS_SHAPE = (1797, 65)


def _digits_csv_path() -> pathlib.Path:
    """Where scikit-learn's bundled ``datasets/data/digits.csv.gz`` lies, found without importing
    scikit-learn (its import takes ~1.7 s, paid by every process that loads digits).

    Raises:
      FileNotFoundError: scikit-learn is not installed, or its package holds no such file.
    """
    spec = importlib.util.find_spec("sklearn")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = pathlib.Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    where = f"in {roots}" if roots else "(scikit-learn is not installed: pip install scikit-learn)"
    raise FileNotFoundError(
        f"data.digits needs scikit-learn's bundled datasets/data/digits.csv.gz; not found {where}."
    )


def _read_digits_csv(path: str | pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """``(data, target)`` of a digits CSV, as ``sklearn.datasets.load_digits`` returns them:
    ``data`` float64 ``[1797, 64]`` pixels in [0, 16], ``target`` int ``[1797]`` in [0, 9]
    (parsed the same way, by ``np.loadtxt``, so the arrays are bit-identical).

    Raises:
      ValueError: the file is damaged (not gzip, not numeric CSV, another shape, labels or
        pixels out of range).
    """
    try:
        with gzip.open(path, mode="rt", encoding="utf-8") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": raised below
            table = np.loadtxt(f, delimiter=",")
    except (OSError, EOFError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"digits file {path} is damaged: {type(e).__name__}: {e}") from e
    if table.shape != _DIGITS_SHAPE:
        raise ValueError(
            f"digits file {path} is damaged: a table of shape {table.shape}, "
            f"expected {_DIGITS_SHAPE} (64 pixels and a label per row)."
        )
    data, target = table[:, :-1], table[:, -1]
    if not (np.all(np.isin(target, np.arange(10))) and np.all((data >= 0) & (data <= 16))):
        raise ValueError(
            f"digits file {path} is damaged: labels must be integers 0..9 and pixels in [0, 16]."
        )
    return data, target.astype(int, copy=False)


def digits(split: str = "train", *, flat: bool = True, test_fraction: float = 0.2) -> ArraySource:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes; no download).

    Pixels are scaled from [0, 16] to [0, 1]. The train/test split is a fixed permutation
    (seed 0), 80/20 by default: 1,438 train and 359 test images. The file is read with numpy
    (:func:`_read_digits_csv`), the same arrays as ``sklearn.datasets.load_digits()``.

    Args:
      split: ``"train"`` or ``"test"``.
      flat: ``x`` of shape ``(64,)`` (for an MLP) or ``(8, 8, 1)`` (for a CNN).
      test_fraction: share of images held out for ``"test"``.

    Returns:
      An :class:`ArraySource` with ``x`` (float32) and ``label`` (int32).
    """
    _validate.check_choice("split", split, SPLITS)
    _validate.check_number("test_fraction", test_fraction, gt=0, lt=1)
    pixels, target = _read_digits_csv(_digits_csv_path())
    x = (pixels / 16.0).astype(np.float32)
    y = target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    idx = order[n_test:] if split == "train" else order[:n_test]
    x = x[idx] if flat else x[idx].reshape(-1, 8, 8, 1)
    return ArraySource({"x": x, "label": y[idx]}, num_classes=10)


def describe(source: Any) -> str:
    """One line naming a source's size."""
    return f"{type(source).__name__} with {len(source)} examples"


def synthetic_images(
    split: str = "train",
    *,
    shape: Sequence[int] = (32, 32, 3),
    num_classes: int = 10,
    num_examples: int = 512,
) -> ArraySource:
    """Random images whose class shifts their mean: learnable, offline, instant.

    For smoke runs and benchmarks of image models when the real dataset is not prepared (the
    Flax examples' fake-data configs). Train and test draw from different seeds.
    """
    _validate.check_choice("split", split, SPLITS)
    rng = np.random.default_rng(0 if split == "train" else 1)
    labels = rng.integers(0, num_classes, num_examples).astype(np.int32)
    centers = np.random.default_rng(42).normal(0, 1, (num_classes, *shape)).astype(np.float32)
    x = centers[labels] + rng.normal(0, 1, (num_examples, *shape)).astype(np.float32)
    return ArraySource({"x": x.astype(np.float32), "label": labels}, num_classes=num_classes)
