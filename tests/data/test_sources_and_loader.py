"""Offline datasets and the seeded, resumable loader with sample ids."""

import gzip
import importlib.machinery
import importlib.util
import re

import numpy as np
import pytest

from jaxcomp import data
from jaxcomp.data import _sources


@pytest.fixture(scope="module")
def digits_train():
    return data.digits("train")


def test_digits_split_is_fixed_disjoint_and_complete(digits_train):
    test = data.digits("test")
    assert (len(digits_train), len(test)) == (1438, 359)
    assert digits_train.arrays["x"].shape[1:] == (64,) and test.arrays["x"].dtype == np.float32
    assert data.digits("test", flat=False).arrays["x"].shape[1:] == (8, 8, 1)
    rows = {r.tobytes() for r in digits_train.arrays["x"]}
    overlap = sum(r.tobytes() in rows for r in test.arrays["x"])
    assert overlap < 5  # a handful of digits are pixel-identical duplicates in the source
    np.testing.assert_array_equal(data.digits("test").arrays["label"], test.arrays["label"])


def test_digits_read_with_numpy_are_bit_identical_to_sklearn_load_digits():
    from sklearn.datasets import load_digits  # the only sklearn import of the suite (~1.7 s)

    bunch = load_digits()
    pixels, target = _sources._read_digits_csv(_sources._digits_csv_path())
    assert pixels.dtype == bunch.data.dtype and target.dtype == bunch.target.dtype
    assert pixels.tobytes() == bunch.data.tobytes() and target.tobytes() == bunch.target.tobytes()
    test = data.digits("test").arrays  # what digits() builds from them: 359 test images
    order = np.random.default_rng(0).permutation(1797)[:359]
    assert test["x"].tobytes() == (bunch.data[order] / 16.0).astype(np.float32).tobytes()
    assert test["label"].tobytes() == bunch.target[order].astype(np.int32).tobytes()


def test_digits_without_the_sklearn_file_names_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="scikit-learn is not installed"):
        data.digits("train")
    spec = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    spec.submodule_search_locations.append(str(tmp_path))  # a package without the file
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(FileNotFoundError, match=r"datasets/data/digits\.csv\.gz; not found in"):
        data.digits("train")


def _table(last_row: bytes, rows: int = 1797) -> bytes:
    """A gzipped digits CSV of ``rows`` rows, the last one ``last_row`` (others: 0s, label 3)."""
    return gzip.compress((b"0," * 64 + b"3\n") * (rows - 1) + last_row)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not gzip", "BadGzipFile"),
        (gzip.compress(b""), r"shape \(0,\)"),
        (gzip.compress(b"1,2,x\n"), "ValueError"),
        (_table(b"", rows=2), r"shape \(65,\)"),
        (_table(b"", rows=1797), r"shape \(1796, 65\)"),
        (_table(b"0," * 63 + b"3\n"), "ValueError"),  # a row one column short
        (_table(b"0," * 64 + b"10\n"), "labels"),
        (_table(b"0," * 64 + b"2.5\n"), "labels"),
        (_table(b"17," * 64 + b"1\n"), "pixels"),
        (_table(b"nan," * 64 + b"1\n"), "pixels"),
    ],
    ids=["not_gzip", "empty", "not_numeric", "one_row", "a_row_missing", "a_column_missing",
         "label_10", "label_2.5", "pixel_17", "pixel_nan"],
)  # fmt: skip
def test_a_damaged_digits_file_is_an_error_naming_it(tmp_path, content, message):
    path = tmp_path / "digits.csv.gz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} is damaged.*{message}"):
        _sources._read_digits_csv(path)


def test_loader_serves_every_example_once_per_epoch_with_ids(digits_train):
    loader = data.Loader(digits_train, 100, seed=3)
    state, seen = loader.initial_state(), []
    for _ in range(loader.steps_per_epoch):
        batch, state = loader.next(state)
        np.testing.assert_array_equal(batch["x"], digits_train.arrays["x"][batch["ids"]])
        np.testing.assert_array_equal(batch["label"], digits_train.arrays["label"][batch["ids"]])
        seen.append(batch["ids"])
    seen = np.concatenate(seen)
    assert len(set(seen.tolist())) == len(seen) == 1400  # 1438 // 100 batches, no repeats
    batch, state = loader.next(state)
    assert state == data.LoaderState(1, 1)
    assert not np.array_equal(batch["ids"], loader.order(0)[:100])  # a fresh permutation


def test_loader_order_depends_only_on_seed_and_epoch_so_resume_is_exact(digits_train):
    a = data.Loader(digits_train, 64, seed=7)
    b = data.Loader(digits_train, 64, seed=7)
    state = a.initial_state()
    for _ in range(30):  # crosses an epoch boundary (22 steps per epoch)
        batch, state = a.next(state)
    resumed = data.LoaderState(*[int(v) for v in state])  # as restored from a checkpoint
    for _ in range(5):
        x1, state = a.next(state)
        x2, resumed = b.next(resumed)
        np.testing.assert_array_equal(x1["ids"], x2["ids"])
    other = data.Loader(digits_train, 64, seed=8)
    assert not np.array_equal(other.order(0), a.order(0))


def _replay(loader, steps, replicas):
    """Each send of a sample over ``steps`` batches, by what the replica that serves it (rows
    ``[r B/R, (r+1) B/R)``, as ``P("data")`` places them) has seen: ``"first"`` (no replica
    has), ``"here"`` (this one has: its per-sample buffer is there), ``"elsewhere"``."""
    seen, counts, state = set(), {"first": 0, "here": 0, "elsewhere": 0}, loader.initial_state()
    rows = loader.batch_size // replicas
    for _ in range(steps):
        batch, state = loader.next(state)
        for r in range(replicas):
            for i in batch["ids"][r * rows : (r + 1) * rows].tolist():
                anywhere = any((q, i) in seen for q in range(replicas))
                counts["here" if (r, i) in seen else "elsewhere" if anywhere else "first"] += 1
                seen.add((r, i))
    return counts


@pytest.mark.parametrize("replicas", [2, 4])
def test_sharded_loader_serves_each_sample_to_one_replica_every_epoch(digits_train, replicas):
    loader = data.Loader(digits_train, 64, seed=3, shards=replicas)
    assert loader.steps_per_epoch == 1438 // 64 == 22  # as many steps as the global shuffle
    rows, state, epochs = 64 // replicas, loader.initial_state(), []
    for _ in range(3):
        ids = []
        for _ in range(loader.steps_per_epoch):
            batch, state = loader.next(state)
            np.testing.assert_array_equal(batch["x"], digits_train.arrays["x"][batch["ids"]])
            owner = np.repeat(np.arange(replicas), rows)
            np.testing.assert_array_equal(batch["ids"] % replicas, owner)  # row block r: shard r
            ids.append(batch["ids"])
        ids = np.concatenate(ids)
        assert len(set(ids.tolist())) == len(ids) == 22 * 64  # no repeats within an epoch
        epochs.append(ids)
    assert not np.array_equal(epochs[0], epochs[1])  # each shard reshuffled per epoch
    # revisits meet their replica's buffer every time (the global shuffle: 38% elsewhere)
    counts = _replay(loader, 66, replicas)
    assert counts["elsewhere"] == 0 and counts["here"] > counts["first"]
    unsharded = _replay(data.Loader(digits_train, 64, seed=3), 66, 2)
    assert unsharded["elsewhere"] > 0.3 * (unsharded["here"] + unsharded["elsewhere"])


def test_sharded_order_is_resumable_and_one_shard_is_the_global_shuffle(digits_train):
    a = data.Loader(digits_train, 64, seed=7, shards=2)
    state = a.initial_state()
    for _ in range(30):  # crosses an epoch boundary
        _, state = a.next(state)
    b = data.Loader(digits_train, 64, seed=7, shards=2)
    resumed = data.LoaderState(*[int(v) for v in state])
    for _ in range(20):
        x1, state = a.next(state)
        x2, resumed = b.next(resumed)
        np.testing.assert_array_equal(x1["ids"], x2["ids"])
    assert not np.array_equal(data.Loader(digits_train, 64, seed=8, shards=2).order(0), a.order(0))
    one = data.Loader(digits_train, 64, seed=7, shards=1)  # today's order, bit for bit
    np.testing.assert_array_equal(one.order(2), np.random.default_rng([7, 2]).permutation(1438))
    assert one.partition == {"examples": 1438, "shards": 1}
    assert a.partition == {"examples": 1438, "shards": 2}


def test_sharded_loader_of_an_uneven_split_serves_every_sample_over_epochs():
    src = data.ArraySource({"x": np.arange(11.0), "label": np.arange(11)})
    loader = data.Loader(src, 4, seed=0, shards=2)  # shards of 6 and 5 samples, 2 rows each
    assert loader.steps_per_epoch == 2 == 11 // 4
    served = np.concatenate([loader.order(e) for e in range(12)])
    assert set(served.tolist()) == set(range(11))  # a shard's tail waits, it is not dropped
    np.testing.assert_array_equal(served.reshape(24, 2, 2) % 2, [[[0, 0], [1, 1]]] * 24)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"shards": 3}, "batch_size 4 is not divisible by shards=3"),
        ({"shards": 0}, "shards must be an integer >= 1"),
        ({"shards": 2, "drop_last": False}, "shards=2 needs drop_last=True"),
        ({"shards": 8}, "batch_size 4 is not divisible by shards=8"),
    ],
)
def test_bad_shards_name_the_problem(kwargs, message):
    src = data.ArraySource({"x": np.arange(10.0), "label": np.arange(10)})
    with pytest.raises(ValueError, match=message):
        data.Loader(src, 4, **kwargs)


def test_eval_loader_pads_the_last_batch_and_masks_it():
    src = data.ArraySource({"x": np.arange(10.0), "label": np.arange(10)})
    batches = list(data.Loader(src, 4, shuffle=False, drop_last=False).epoch())
    assert [b["mask"].tolist() for b in batches][-1] == [1.0, 1.0, 0.0, 0.0]
    real = np.concatenate([b["ids"][b["mask"] > 0] for b in batches])
    np.testing.assert_array_equal(real, np.arange(10))


def test_crop_flip_is_reproducible_per_seed_epoch_and_id():
    x = np.random.default_rng(0).random((4, 8, 8, 3)).astype(np.float32)
    ids = np.array([5, 6, 7, 8])
    a = data.crop_flip(x, ids, seed=0, epoch=2)
    np.testing.assert_array_equal(a, data.crop_flip(x, ids, seed=0, epoch=2))
    assert not np.array_equal(a, data.crop_flip(x, ids, seed=0, epoch=3))
    assert a.shape == x.shape


def test_bad_dataset_arguments():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        data.get_dataset("imagenet", "train")
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['seq'\]"):
        data.get_dataset("pydoc_text", "train", seq=4)
    with pytest.raises(ValueError, match="split must be one of"):
        data.digits("validation")
    with pytest.raises(ValueError, match="batch_size 5000 exceeds"):
        data.Loader(data.digits("test"), 5000)
