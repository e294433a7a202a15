"""Deterministic, resumable batching with sample ids.

The order of epoch ``e`` is a permutation drawn from ``numpy.random.default_rng([seed, e])``,
so it depends on nothing but the seed and the epoch: a run resumed from a checkpointed
:class:`LoaderState` sees exactly the batches an uninterrupted run would. Every batch carries
``ids``, the examples' indices in the split, which per-sample channels (AQ-SGD) key their
buffers by.

With ``shards=R`` (a run whose data replicas each keep per-sample buffers) sample ``i``
belongs to replica ``i mod R`` for the whole run: each epoch shuffles every shard on its own,
and rows ``[r B/R, (r+1) B/R)`` of every batch (replica ``r``'s rows under ``P("data")``) come
from shard ``r``, so a revisited sample always meets the buffer its replica keeps for it.
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
      shards: ``R``, the data replicas that keep per-sample buffers (1: the whole split is
        shuffled over the batch). With ``R > 1`` sample ``i`` is served only in rows
        ``[r B/R, (r+1) B/R)`` of a batch, ``r = i mod R``: interleaved shards, so that each
        replica draws from the whole of a split stored in order (documents, classes), not
        from one end of it. Each epoch serves the first ``steps_per_epoch * B/R`` samples of
        every shard's permutation, ``steps_per_epoch = (N // R) // (B/R)`` (the same count as
        ``N // B``): the rest of a shard (fewer than ``B/R + 1`` samples) waits for a later
        epoch, as the tail of the global permutation does without shards. Needs
        ``drop_last`` and ``B`` divisible by ``R`` (then ``N >= B`` gives every shard at least
        ``B/R`` samples).

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
        shards: int = 1,
    ):
        _validate.check_int("batch_size", batch_size, 1)
        _validate.check_choice("augment", augment, AUGMENTATIONS)
        shards = _validate.check_int("shards", shards, 1)
        n = len(source)
        if drop_last and n < batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {n} examples of the split.")
        if shards > 1 and not drop_last:
            raise ValueError(
                f"shards={shards} needs drop_last=True: per-replica shards are for training "
                "batches (an evaluation pass pads its last batch and keeps no per-sample buffers)."
            )
        if batch_size % shards:
            raise ValueError(
                f"batch_size {batch_size} is not divisible by shards={shards}: each data replica "
                "takes an equal part of every batch from its own shard."
            )
        self.source, self.batch_size, self.seed = source, batch_size, int(seed)
        self.shuffle, self.drop_last, self.augment = shuffle, drop_last, augment
        self.num_examples, self.shards = n, shards
        if shards > 1:
            self.steps_per_epoch = (n // shards) // (batch_size // shards)
        else:
            self.steps_per_epoch = n // batch_size if drop_last else -(-n // batch_size)

    @property
    def partition(self) -> dict[str, int]:
        """What a checkpoint records of how the split is cut over the replicas: a resume on
        another cut would hand the samples of one replica's buffers to another."""
        return {"examples": self.num_examples, "shards": self.shards}

    def initial_state(self) -> LoaderState:
        return LoaderState(0, 0)

    def order(self, epoch: int) -> np.ndarray:
        """The example indices of ``epoch``, in the order they are served (with shards, only
        the ``steps_per_epoch * batch_size`` served)."""
        if self.shards > 1:
            return self._sharded_order(epoch)
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_examples)

    def _sharded_order(self, epoch: int) -> np.ndarray:
        r, rows = self.shards, self.batch_size // self.shards
        served = self.steps_per_epoch * rows
        rng = np.random.default_rng([self.seed, int(epoch)]) if self.shuffle else None
        per_shard = []
        for k in range(r):
            shard = np.arange(k, self.num_examples, r)
            if rng is not None:
                shard = shard[rng.permutation(len(shard))]
            per_shard.append(shard[:served])
        # [shard, step, row] -> [step, shard, row]: each batch is shard 0's rows, shard 1's, ...
        stacked = np.stack(per_shard).reshape(r, self.steps_per_epoch, rows)
        return stacked.transpose(1, 0, 2).reshape(-1)

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
