"""Tiny stand-ins for tfds datasets, written in ``array_record`` format without TensorFlow.

A paper-scale config reads CIFAR-10 or a text corpus through ``tfds.data_source``; preparing the
real dataset needs TensorFlow once and a download. To run such a config's smoke variant offline
(in the tests, or to check a setup before a long run), :func:`write_fake_tfds` writes a few
examples under the real dataset's name, version and features into a data_dir of your choice:
``tfds.data_source(name, data_dir=...)`` then reads them through the dataset's own registered
builder, exactly as it would read the prepared dataset.

The examples are fake (random class-dependent images, an excerpt of Python's documentation as
text): use them to check that a run starts, never to measure accuracy. The writer refuses a
data_dir that already holds the dataset, so it cannot overwrite or mix with prepared data.
"""

from __future__ import annotations

import contextlib
import io
import os

import numpy as np

from jaxcomp import _validate

#: datasets :func:`write_fake_tfds` can imitate, with the splits it writes
FAKE_TFDS = {
    "cifar10": ("train", "test"),
    "mnist": ("train", "test"),
    "tiny_shakespeare": ("train", "validation", "test"),
}
_IMAGE_SHAPES = {"cifar10": (32, 32, 3), "mnist": (28, 28, 1)}


def _features(name: str):
    import tensorflow_datasets as tfds

    f = tfds.features
    if name == "cifar10":  # as tensorflow_datasets.image_classification.cifar.Cifar10
        spec = {
            "id": f.Text(),
            "image": f.Image(shape=_IMAGE_SHAPES[name]),
            "label": f.ClassLabel(num_classes=10),
        }
    elif name == "mnist":
        spec = {"image": f.Image(shape=_IMAGE_SHAPES[name]), "label": f.ClassLabel(num_classes=10)}
    else:  # tiny_shakespeare: one record per split holding the whole text
        spec = {"text": f.Text()}
    return f.FeaturesDict(spec)


def _image_examples(name: str, split_index: int, n: int, seed: int):
    """``n`` uint8 images whose class shifts their mean, as PIL images (PNG-encoded without TF)."""
    import PIL.Image

    shape = _IMAGE_SHAPES[name]
    centers = np.random.default_rng([seed, 99]).uniform(40, 215, (10, *shape))
    rng = np.random.default_rng([seed, split_index])
    for i in range(n):
        label = i % 10
        img = np.clip(centers[label] + rng.normal(0, 30, shape), 0, 255).astype(np.uint8)
        pil = PIL.Image.fromarray(img[..., 0] if shape[-1] == 1 else img)
        example = {"image": pil, "label": label}
        if name == "cifar10":
            example["id"] = f"fake_{split_index}_{i:05d}"
        yield i, example


def _text_examples(split_index: int, n: int):
    """One record of ``n`` characters: a slice of Python's bundled documentation."""
    from jaxcomp.data._text import pydoc_corpus

    text = pydoc_corpus()[0].decode("utf-8", errors="ignore")
    start = split_index * n
    yield 0, {"text": text[start : start + n]}


def write_fake_tfds(
    name: str,
    data_dir: str,
    *,
    num_examples: int = 64,
    num_chars: int = 8192,
    seed: int = 0,
) -> str:
    """Writes a tiny fake copy of a tfds dataset (array_record, no TensorFlow) into ``data_dir``.

    Image datasets get ``num_examples`` images per split, label ``i % 10`` for the ``i``-th
    (before tfds shuffles the records by key), each image its class's random mean plus noise.
    Text datasets get one record per split of ``num_chars`` characters of Python's bundled
    documentation (a different slice per split).

    Args:
      name: one of :data:`FAKE_TFDS` (``"cifar10"``, ``"mnist"``, ``"tiny_shakespeare"``).
      data_dir: where to write; the dataset lands in ``data_dir/name/VERSION`` with the version
        of tfds's registered builder, where ``tfds.data_source`` looks for it.
      num_examples: images per split (``>= 1``).
      num_chars: characters per text split (``>= 2``).
      seed: seed of the images.

    Returns:
      The directory the dataset was written to.

    Raises:
      ValueError: for a name not in :data:`FAKE_TFDS`, a non-positive size, or a data_dir that
        already holds this dataset (fake data never overwrites or joins a prepared one).

    Example:
      >>> import tempfile
      >>> from jaxcomp import data
      >>> with tempfile.TemporaryDirectory() as d:
      ...     _ = data.write_fake_tfds("tiny_shakespeare", d, num_chars=64)
      ...     len(data.tfds_text("tiny_shakespeare", "test", data_dir=d, seq_len=16))
      3
    """
    import tensorflow_datasets as tfds

    if name not in FAKE_TFDS:
        raise ValueError(f"write_fake_tfds: name must be one of {sorted(FAKE_TFDS)}; got {name!r}.")
    _validate.check_int("num_examples", num_examples, 1)
    _validate.check_int("num_chars", num_chars, 2)
    version = tfds.builder_cls(name).VERSION
    target = os.path.join(os.fspath(data_dir), name, str(version))
    if os.path.exists(target):
        raise ValueError(
            f"{target} already exists; write_fake_tfds never writes over a prepared dataset "
            "(use an empty data_dir)."
        )
    splits = FAKE_TFDS[name]

    class Fake(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = version
        # a one-part module name keeps tfds from resolving the builder's code path as a
        # package resource (which needs the optional importlib_resources backport)
        __module__ = "jaxcomp_fake_tfds"

        def _info(self):
            keys = ("image", "label") if name in _IMAGE_SHAPES else None
            return tfds.core.DatasetInfo(
                builder=self, features=_features(name), supervised_keys=keys
            )

        def _split_generators(self, dl_manager):
            return {s: self._generate_examples(i) for i, s in enumerate(splits)}

        def _generate_examples(self, split_index):
            if name in _IMAGE_SHAPES:
                return _image_examples(name, split_index, num_examples, seed)
            return _text_examples(split_index, num_chars)

    Fake.name = name  # the registered dataset's name: files land where data_source looks
    builder = Fake(data_dir=os.fspath(data_dir), file_format="array_record")
    quiet = io.StringIO()  # tfds prints "Downloading and preparing..." and progress bars
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        builder.download_and_prepare()
    return target
