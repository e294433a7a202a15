"""The text that ships with Python: a split by document that shares no text, its identity, the
unigram reference perplexity."""

import hashlib
import json
import math
import pathlib

import ml_collections
import numpy as np
import pytest

from jaxcomp import data
from jaxcomp import train
from jaxcomp.data import _text


@pytest.fixture(scope="module")
def splits():
    return {s: data.pydoc_text(s, seq_len=32) for s in ("train", "test")}


def _stream(names):
    docs = data.pydoc_documents()
    return _text.SEPARATOR.join(docs[k] for k in names)


def test_the_split_is_deterministic_by_document_and_shares_no_64_byte_string(splits):
    train, test = splits["train"], splits["test"]
    names = test.info["test"]["documents"]
    assert test.info == train.info  # both splits carry the same identity
    assert 0 < len(names) < test.info["documents"]
    again = data.pydoc_text("test", seq_len=32)
    np.testing.assert_array_equal(again.arrays["x"], test.arrays["x"])
    assert again.info["test"]["documents"] == names
    train_names = sorted(set(data.pydoc_documents()) - set(names))
    assert test.info["train"]["documents"] == len(train_names)
    train_text, test_text = _stream(train_names), _stream(names)
    assert len(test_text) >= 0.1 * (len(train_text) + len(test_text))
    shared = np.intersect1d(
        _text._window_hashes(train_text, 64), _text._window_hashes(test_text, 64)
    )
    assert shared.size == 0  # no 64-byte string of the validation text is trained on
    for split, text in (("train", train_text), ("test", test_text)):
        src = splits[split]
        assert src.info[split]["sha256"] == hashlib.sha256(text).hexdigest()
        x, y = src.arrays["x"], src.arrays["label"]
        assert x.shape == ((len(text) - 1) // 32, 32) and x.dtype == np.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # next-token pairs
        np.testing.assert_array_equal(x[0], np.frombuffer(text[:32], np.uint8))


def test_the_identity_names_the_file_its_hash_and_the_reference_perplexity(splits):
    import pydoc_data.topics

    info = splits["test"].info
    raw = pathlib.Path(pydoc_data.topics.__file__).read_bytes()
    assert info["files"] == [
        {
            "path": "pydoc_data/topics.py",
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
    ]
    text, sha = data.pydoc_corpus()
    assert (info["corpus_sha256"], info["corpus_bytes"]) == (sha, len(text))
    assert info["python"].count(".") == 2 and info["seq_len"] == 32
    train_tokens = np.frombuffer(
        _stream(sorted(set(data.pydoc_documents()) - set(info["test"]["documents"]))), np.uint8
    )
    expected = data.unigram_perplexity(train_tokens, splits["test"].arrays["label"], 256)
    assert info["unigram_perplexity"] == expected and 10 < expected < 60
    with pytest.raises(ValueError, match="sha256"):
        data.pydoc_text(expected_sha256="0" * 64)


def test_a_subset_of_train_windows_is_evenly_spaced_and_leaves_validation_alone(splits):
    full = splits["train"].arrays["x"]
    sub = data.pydoc_text("train", seq_len=32, max_train_windows=100)
    np.testing.assert_array_equal(sub.arrays["x"], full[np.arange(100) * len(full) // 100])
    assert sub.info["train"]["windows"] == 100 and sub.info["max_train_windows"] == 100
    test = data.pydoc_text("test", seq_len=32, max_train_windows=100)
    np.testing.assert_array_equal(test.arrays["x"], splits["test"].arrays["x"])
    with pytest.raises(ValueError, match="max_train_windows 99999 exceeds the"):
        data.pydoc_text("train", seq_len=32, max_train_windows=99999)
    with pytest.raises(ValueError, match="max_train_windows must be None or an integer >= 1"):
        data.pydoc_text("train", max_train_windows=0)


def test_documents_sharing_a_string_stay_on_one_side():
    shared = b"x" * 64
    docs = {"a": b"1" * 70 + shared, "b": b"2" * 70, "c": shared + b"3" * 70, "d": b"4" * 300}
    assert data.document_groups(docs) == [["a", "c"], ["b"], ["d"]]
    assert data.document_groups(docs, shared_bytes=65) == [["a"], ["b"], ["c"], ["d"]]
    train, test = data.split_documents(docs, 0.1)
    assert sorted(train + test) == sorted(docs) and not set(train) & set(test)
    assert {"a", "c"} <= set(train) or {"a", "c"} <= set(test)
    assert data.split_documents(docs, 0.1) == (train, test)  # deterministic


@pytest.mark.parametrize(
    "docs, fraction, match",
    [
        ({"a": b"x" * 100}, 0.1, "cannot hold out"),  # one group: nothing left to train on
        ({"a": b"x" * 100, "b": b"y" * 100}, 0.0, "test_fraction must be a number > 0"),
        ({"a": b"x" * 100, "b": b"x" * 100}, 0.1, "cannot hold out"),  # linked: one group
        ({"a": b"", "b": b""}, 0.1, "cannot hold out 0.1 of 0 bytes"),
        ({"a": b"x" * 900, "b": b"y" * 100}, 0.01, "cannot hold out"),  # past twice the fraction
    ],
)
def test_a_split_that_cannot_be_made_is_an_error(docs, fraction, match):
    with pytest.raises(ValueError, match=match):
        data.split_documents(docs, fraction)


def test_unigram_perplexity_reference_values_and_bad_tokens():
    assert data.unigram_perplexity(np.arange(4), np.arange(4), 4) == pytest.approx(4.0)
    p = np.array([4, 2]) / 6  # counts 3 and 1, add-one smoothed
    expected = np.exp(-np.mean(np.log(p[[0, 1]])))
    assert data.unigram_perplexity([0, 0, 0, 1], [0, 1], 2) == pytest.approx(expected)
    assert np.isfinite(data.unigram_perplexity([0, 0], [1], 2))  # unseen in training: finite
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 2\)"):
        data.unigram_perplexity([0], [2], 2)
    with pytest.raises(ValueError, match="train_tokens must be integer tokens"):
        data.unigram_perplexity(np.array([0.5]), [0], 2)
    with pytest.raises(ValueError, match="at least one token"):
        data.unigram_perplexity([0], [], 2)


def test_token_windows_edges():
    np.testing.assert_array_equal(data.token_windows(np.arange(7), 3), [[0, 1, 2, 3], [3, 4, 5, 6]])
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        data.token_windows(np.arange(7), 0)
    with pytest.raises(ValueError, match="cannot fill one window"):
        data.token_windows(np.arange(3), 3)


def test_a_tiny_gpt_trains_on_it_and_records_identity_and_perplexity(tmp_path, fast_compiles):
    c = ml_collections.ConfigDict(dict(
        mode="dense", mesh=[("data", 8)], model_name="gpt", data_name="pydoc_text",
        model=dict(vocab_size=256, seq_len=8, dim=8, num_blocks=1, num_heads=1, cuts=()),
        data=dict(seq_len=8), batch_size=8, eval_batch_size=512, optax_name="adam", lr=3e-3,
        total_steps=2, log_every=1, eval_every=0, checkpoint_every=0,
    ))  # fmt: skip
    summary = train.train_and_evaluate(c, str(tmp_path))
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    identity = data.pydoc_text("test", seq_len=8).info
    assert on_disk["dataset"]["corpus_sha256"] == identity["corpus_sha256"]
    assert on_disk["dataset"]["test"] == identity["test"]  # the documents, bytes, hash
    assert on_disk["unigram_perplexity"] == pytest.approx(identity["unigram_perplexity"])
    final = train.read_metrics(str(tmp_path))[-1]
    assert final["split"] == "eval"
    assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))
    assert summary["final_perplexity"] == final["perplexity"]
