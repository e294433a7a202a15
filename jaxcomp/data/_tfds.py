"""Real datasets through tensorflow-datasets' random-access ``data_source`` (no TensorFlow).

``tfds.data_source`` reads ``array_record`` files directly; ``tfds.load`` would need
TensorFlow. Datasets must already be prepared in ``data_dir`` in the ``array_record`` format
(``tfds build --file_format=array_record``, or a builder's
``download_and_prepare(file_format="array_record")``); nothing is downloaded unless
``download=True``. Preparing an image dataset encodes PNGs through TensorFlow (once, in any
environment that has it); reading decodes them with Pillow, no TensorFlow.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from jaxcomp.data import _sources
from jaxcomp.data import _text

#: per-channel mean and std used to normalise CIFAR images (kuangliu/pytorch-cifar)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2023, 0.1994, 0.2010)


class TfdsImageSource:
    """Images scaled to [0, 1] and normalised per channel, with integer labels.

    Wraps a ``tfds`` data source; rows come back as ``{"x": float32 [H, W, C], "label": int32}``.
    A record that cannot be read (a damaged file) raises a ``ValueError`` naming the dataset.

    Attributes:
      num_classes: the label feature's number of classes (``None`` if it is not a ClassLabel).
    """

    def __init__(self, source, *, image_key="image", label_key="label", mean=None, std=None):
        self.source = source
        self.image_key, self.label_key = image_key, label_key
        self.mean = None if mean is None else np.asarray(mean, np.float32)
        self.std = None if std is None else np.asarray(std, np.float32)
        info = getattr(source, "dataset_info", None)
        feature = None if info is None else info.features[label_key]
        self.num_classes = getattr(feature, "num_classes", None)

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        rows = _read(self.source, [int(i) for i in indices])
        x = np.stack([np.asarray(r[self.image_key]) for r in rows])
        if np.issubdtype(x.dtype, np.integer):
            x = x.astype(np.float32) / 255.0
        x = x.astype(np.float32)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        labels = np.asarray([r[self.label_key] for r in rows], np.int32)
        return {"x": x, "label": labels}


def data_dir_of(data_dir: str | None) -> str:
    """The directory tfds reads: ``data_dir``, else tfds's default (``$TFDS_DATA_DIR``)."""
    if data_dir is not None:
        return os.fspath(data_dir)
    from tensorflow_datasets.core import constants

    return os.fspath(constants.DATA_DIR)


def prepare_message(name: str, split: str, data_dir: str | None) -> str:
    """The one line that says a dataset is missing and how to prepare it."""
    where = data_dir_of(data_dir)
    return (
        f"tfds dataset {name!r} (split {split!r}) is not prepared in {where} in array_record "
        f"format; prepare it with `tfds build {name} --file_format=array_record "
        f"--data_dir={where}` (needs TensorFlow once), or set data.data_dir to where it is."
    )


def _one_line(e: BaseException, limit: int = 240) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


def _read(source, indices: list[int]):
    try:
        return source.__getitems__(indices)
    except Exception as e:  # riegeli/array_record raise RuntimeError for damaged files
        split = getattr(source, "split", "?")
        raise ValueError(
            f"tfds split {split!r}: reading records {indices[:4]} failed ({_one_line(e)}); the "
            "prepared files may be damaged: prepare the dataset again."
        ) from e


def _fake_dir(name: str, data_dir: str | None, download: bool) -> str:
    """A fresh temporary data_dir holding a generated copy of ``name``
    (:func:`~jaxcomp.data.write_fake_tfds`), removed when the process exits."""
    import atexit
    import shutil
    import tempfile

    from jaxcomp.data import _fake_tfds

    if data_dir is not None or download:
        raise ValueError(
            f"tfds dataset {name!r}: fake=True reads a generated copy; it takes no data_dir "
            f"({data_dir!r}) and no download."
        )
    where = tempfile.mkdtemp(prefix=f"jaxcomp-fake-{name}-")
    atexit.register(shutil.rmtree, where, True)
    _fake_tfds.write_fake_tfds(name, where)
    return where


def _open(name: str, split: str, data_dir: str | None, download: bool, fake: bool = False):
    import tensorflow_datasets as tfds

    if fake:
        data_dir = _fake_dir(name, data_dir, download)

    try:
        src = tfds.data_source(name, split=split, data_dir=data_dir, download=download)
    except Exception as e:  # tfds raises several types for "not prepared here"
        raise ValueError(f"{prepare_message(name, split, data_dir)} ({_one_line(e)})") from e
    if len(src) == 0:
        raise ValueError(f"tfds dataset {name!r} split {split!r} has no examples.")
    _read(src, sorted({0, len(src) - 1}))  # a truncated first or last shard fails here, not later
    return src


def tfds_images(
    name: str,
    split: str = "train",
    *,
    data_dir: str | None = None,
    image_key: str = "image",
    label_key: str = "label",
    normalize: str | None = None,
    download: bool = False,
    fake: bool = False,
) -> TfdsImageSource:
    """An image-classification split (cifar10, mnist, ...) read from array_record files.

    Args:
      name: tfds dataset name.
      split: tfds split (``"train"``, ``"test"``, ``"train[:10%]"``...).
      data_dir: where the prepared dataset lives.
      image_key, label_key: feature names.
      normalize: ``"cifar"`` for the CIFAR mean/std, or ``None``.
      download: allow tfds to download and prepare (off by default: nothing downloads).
      fake: read a small generated copy instead (:func:`~jaxcomp.data.write_fake_tfds`, 64
        images per split, written to a temporary directory; no download, no ``data_dir``): the
        paper configs' ``:smoke`` runs.
    """
    if normalize not in (None, "cifar"):
        raise ValueError(f"normalize must be None or 'cifar'; got {normalize!r}.")
    src = _open(name, split, data_dir, download, fake)
    mean, std = (CIFAR_MEAN, CIFAR_STD) if normalize == "cifar" else (None, None)
    return TfdsImageSource(src, image_key=image_key, label_key=label_key, mean=mean, std=std)


def tfds_text(
    name: str = "tiny_shakespeare",
    split: str = "train",
    *,
    data_dir: str | None = None,
    text_key: str = "text",
    seq_len: int = 128,
    download: bool = False,
    fake: bool = False,
) -> _sources.ArraySource:
    """A text split (tiny_shakespeare, wikitext, ...) as byte-level LM windows.

    Every record's ``text_key`` feature is UTF-8 encoded and the records are joined with
    newlines, then cut as :func:`~jaxcomp.data.pydoc_text` does.

    Args:
      name: tfds dataset name (default ``"tiny_shakespeare"``, the character-level LM corpus).
      split: tfds split.
      data_dir: where the prepared dataset lives.
      text_key: the text feature's name.
      seq_len: tokens per example.
      download: allow tfds to download and prepare (off by default: nothing downloads).
      fake: read a small generated copy instead (:func:`~jaxcomp.data.write_fake_tfds`).
    """
    src = _open(name, split, data_dir, download, fake)
    parts = []
    for row in _read(src, list(range(len(src)))):
        t = row[text_key]
        parts.append(t if isinstance(t, bytes) else str(t).encode("utf-8"))
    tokens = np.frombuffer(b"\n".join(parts), np.uint8)
    return _text.lm_source(_text.token_windows(tokens, seq_len))
