"""Datasets with no download by default, and deterministic resumable batching with sample ids.

* :func:`digits`: scikit-learn's bundled 8x8 handwritten digits.
* :func:`pydoc_text`: byte-level LM windows of Python's bundled documentation, split by
  document (:func:`split_documents`), its identity and :func:`unigram_perplexity` in ``info``.
* :func:`synthetic_images`: class-dependent random images for smoke runs.
* :func:`tfds_images`, :func:`tfds_text`: tensorflow-datasets ``data_source`` (array_record,
  no TensorFlow) for cifar10, mnist, tiny_shakespeare, wikitext, ... prepared beforehand;
  :func:`write_fake_tfds` writes a tiny fake copy of some of them for smoke runs.
* :class:`Loader`: batches in a seeded per-epoch order, each carrying ``ids``; its
  :class:`LoaderState` goes into the checkpoint.
"""

from jaxcomp.data._fake_tfds import FAKE_TFDS
from jaxcomp.data._fake_tfds import write_fake_tfds
from jaxcomp.data._loader import AUGMENTATIONS
from jaxcomp.data._loader import Loader
from jaxcomp.data._loader import LoaderState
from jaxcomp.data._loader import crop_flip
from jaxcomp.data._loader import get_dataset
from jaxcomp.data._sources import ArraySource
from jaxcomp.data._sources import Source
from jaxcomp.data._sources import digits
from jaxcomp.data._sources import synthetic_images
from jaxcomp.data._text import PYDOC_TOPICS_SHA256
from jaxcomp.data._text import document_groups
from jaxcomp.data._text import lm_source
from jaxcomp.data._text import pydoc_corpus
from jaxcomp.data._text import pydoc_documents
from jaxcomp.data._text import pydoc_text
from jaxcomp.data._text import split_documents
from jaxcomp.data._text import token_windows
from jaxcomp.data._text import unigram_perplexity
from jaxcomp.data._tfds import CIFAR_MEAN
from jaxcomp.data._tfds import CIFAR_STD
from jaxcomp.data._tfds import TfdsImageSource
from jaxcomp.data._tfds import prepare_message
from jaxcomp.data._tfds import tfds_images
from jaxcomp.data._tfds import tfds_text

__all__ = (
    "AUGMENTATIONS",
    "CIFAR_MEAN",
    "CIFAR_STD",
    "FAKE_TFDS",
    "PYDOC_TOPICS_SHA256",
    "ArraySource",
    "Loader",
    "LoaderState",
    "Source",
    "TfdsImageSource",
    "crop_flip",
    "digits",
    "document_groups",
    "get_dataset",
    "lm_source",
    "pydoc_corpus",
    "pydoc_documents",
    "prepare_message",
    "pydoc_text",
    "split_documents",
    "tfds_images",
    "tfds_text",
    "synthetic_images",
    "token_windows",
    "unigram_perplexity",
    "write_fake_tfds",
)
