"""Deterministic, resumable batching with sample ids.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``,
so it depends on nothing but the seed and the epoch: a run resumed from a checkpointed
:class:`LoaderState` sees exactly the batches an uninterrupted run would. Every batch carries
``ids``, the examples' indices in the split, which per-sample channels (AQ-SGD) key their
buffers by.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from jaxcomp import _validate
from jaxcomp.data import _sources
from jaxcomp.data import _text

AUGMENTATIONS = (None, "crop_flip")


class LoaderState(NamedTuple):
    """Where a loader is: the epoch and the number of batches already taken from it."""

    epoch: int
    index: int


class Loader:
    """Batches of a source in a seeded order, with sample ids and a resumable position.

    Args:
      source: a random-access source (see :class:`~jaxcomp.data.Source`).
      batch_size: examples per batch.
      seed: seed of the shuffling (and of augmentation).
      shuffle: draw a fresh permutation each epoch; otherwise keep the source's order.
      drop_last: drop the final partial batch of an epoch (training). If false, the last batch
        is padded by repeating examples, and ``batch["mask"]`` marks the real rows (evaluation).
      augment: ``None``, or ``"crop_flip"`` (pad-4 random crop and horizontal flip of ``x``
        images, drawn from the seed, epoch and id: reproducible on resume).

    Example:
      >>> src = _sources.ArraySource({"x": np.arange(10.0), "label": np.arange(10)})
      >>> loader = Loader(src, 4, seed=0)
      >>> batch, state = loader.next(loader.initial_state())
      >>> sorted(batch), state
      (['ids', 'label', 'x'], LoaderState(epoch=0, index=1))
    """

    def __init__(
        self,
        source,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        augment: str | None = None,
    ):
        _validate.check_int("batch_size", batch_size, 1)
        _validate.check_choice("augment", augment, AUGMENTATIONS)
        n = len(source)
        if drop_last and n < batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} examples of the split.")
        self.source, self.batch_size, self.seed = source, batch_size, int(seed)
        self.shuffle, self.drop_last, self.augment = shuffle, drop_last, augment
        self.num_examples = n
        self.steps_per_epoch = n // batch_size if drop_last else -(-n // batch_size)

    def initial_state(self) -> LoaderState:
        return LoaderState(0, 0)

    def order(self, epoch: int) -> np.ndarray:
        """The example indices of ``epoch``, in the order they are served."""
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)

    def next(self, state: LoaderState) -> tuple[dict[str, np.ndarray], LoaderState]:
        """The batch at ``state`` and the state after it (pure in ``state``)."""
        epoch, index = int(state.epoch), int(state.index)
        if index >= self.steps_per_epoch:
            epoch, index = epoch + 1, 0
        start = index * self.batch_size
        ids = self.order(epoch)[start : start + self.batch_size]
        real = len(ids)
        if real < self.batch_size:  # only when not drop_last
            ids = np.concatenate([ids, np.resize(ids, self.batch_size - real)])
        batch = dict(self.source.__getitems__(ids))
        batch["ids"] = ids.astype(np.int32)
        if not self.drop_last:
            batch["mask"] = (np.arange(self.batch_size) < real).astype(np.float32)
        if self.augment == "crop_flip":
            batch["x"] = crop_flip(batch["x"], batch["ids"], self.seed, epoch)
        return batch, LoaderState(epoch, index + 1)

    def epoch(self, epoch: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """All batches of one epoch (e.g. an evaluation pass)."""
        state = LoaderState(epoch, 0)
        for _ in range(self.steps_per_epoch):
            batch, state = self.next(state)
            yield batch


def crop_flip(x: np.ndarray, ids: np.ndarray, seed: int, epoch: int, pad: int = 4) -> np.ndarray:
    """Random pad-and-crop shift and horizontal flip per image, seeded by (seed, epoch, id)."""
    if x.ndim != 4:
        raise ValueError(f"crop_flip needs images [B, H, W, C]; got shape {x.shape}.")
    b, h, w, _ = x.shape
    padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="constant")
    out = np.empty_like(x)
    for i in range(b):
        rng = np.random.default_rng([seed, epoch, int(ids[i]), 1])
        dy, dx = rng.integers(0, 2 * pad + 1, size=2)
        img = padded[i, dy : dy + h, dx : dx + w]
        out[i] = img[:, ::-1] if rng.random() < 0.5 else img
    return out


def get_dataset(data_name: str, split: str, /, **kwargs) -> _sources.Source:
    """A split of a dataset by name: ``"digits"``, ``"pydoc_text"``, ``"synthetic_images"``,
    ``"tfds_images"`` or ``"tfds_text"`` (keyword arguments go to the function of that name).

    ``data_name`` and ``split`` are positional-only, so the keyword arguments may hold a
    ``name`` of their own (the tfds dataset of ``tfds_images``/``tfds_text``).

    Raises:
      ValueError: for an unknown dataset name or keyword.

    Example:
      >>> len(get_dataset("digits", "test"))
      359
    """
    import inspect

    from jaxcomp.data import _tfds

    table = {
        "digits": _sources.digits,
        "pydoc_text": _text.pydoc_text,
        "synthetic_images": _sources.synthetic_images,
        "tfds_images": _tfds.tfds_images,
        "tfds_text": _tfds.tfds_text,
    }
    if data_name not in table:
        raise ValueError(f"unknown dataset {data_name!r}; allowed datasets are {sorted(table)}.")
    allowed = set(inspect.signature(table[data_name]).parameters) - {"split"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {unknown} for dataset {data_name!r}; allowed are "
            f"{sorted(allowed)}."
        )
    return table[data_name](split=split, **kwargs)
