"""Datasets with no download by default, and deterministic resumable batching with sample ids.

* :func:`digits`: scikit-learn's bundled 8x8 handwritten digits.
* :func:`pydoc_text`: byte-level LM windows of Python's bundled documentation (hash-pinned).
* :func:`tfds_images`, :func:`tfds_text`: tensorflow-datasets ``data_source`` (array_record,
  no TensorFlow) for cifar10, mnist, tiny_shakespeare, wikitext, ... prepared beforehand.
* :class:`Loader`: batches in a seeded per-epoch order, each carrying ``ids``; its
  :class:`LoaderState` goes into the checkpoint.
"""

from jaxcomp.data._loader import AUGMENTATIONS, Loader, LoaderState, crop_flip, get_dataset
from jaxcomp.data._sources import (
    PYDOC_TOPICS_SHA256,
    ArraySource,
    Source,
    digits,
    lm_source,
    pydoc_corpus,
    pydoc_text,
    token_windows,
)
from jaxcomp.data._tfds import CIFAR_MEAN, CIFAR_STD, TfdsImageSource, tfds_images, tfds_text

__all__ = (
    "AUGMENTATIONS",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "PYDOC_TOPICS_SHA256",
    "ArraySource",
    "Loader",
    "LoaderState",
    "Source",
    "TfdsImageSource",
    "crop_flip",
    "digits",
    "get_dataset",
    "lm_source",
    "pydoc_corpus",
    "pydoc_text",
    "tfds_images",
    "tfds_text",
    "token_windows",
)
