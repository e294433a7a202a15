"""Byte-level language-modelling text that ships with Python, split by document, with its
identity and the unigram reference perplexity.

The corpus is ``pydoc_data/topics.py`` (CPython's help topics: 79 documents, 466,117 bytes of
English prose on Python 3.11.7), split so that no validation text is trained on: documents that
share a 64-byte string stay on one side (:func:`document_groups`, :func:`split_documents`). It
differs between Python versions, so every split carries its identity
(:attr:`~jaxcomp.data.ArraySource.info`: the file, its size and SHA-256, the documents of each
split with their sizes and hashes), which the trainer writes into the run's ``summary.json``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxcomp import _validate
from jaxcomp.data import _sources

#: SHA-256 of the pydoc topics corpus (keys sorted, joined with "\n\n") on Python 3.11.7.
#: The corpus differs between Python versions; :func:`pydoc_text` warns when it does not match.
PYDOC_TOPICS_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"
#: what separates two documents of a split in its token stream
SEPARATOR = b"\n\n"


def pydoc_documents() -> dict[str, bytes]:
    """The help topics of Python's bundled ``pydoc_data.topics``, by name, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return {k: topics[k].encode("utf-8") for k in sorted(topics)}


def pydoc_corpus() -> tuple[bytes, str]:
    """The English text of Python's bundled ``pydoc_data.topics`` as UTF-8 bytes, and its SHA-256.

    Topics are joined in sorted key order with blank lines between them.
    """
    text = SEPARATOR.join(pydoc_documents().values())
    return text, hashlib.sha256(text).hexdigest()


#: an odd multiplier for :func:`_window_hashes` (arithmetic modulo 2**64 wraps in uint64)
_HASH_BASE = 0x100000001B3


def _window_hashes(data: bytes, n: int) -> np.ndarray:
    """A 64-bit polynomial hash of every ``n``-byte window of ``data`` (distinct values)."""
    b = np.frombuffer(data, np.uint8).astype(np.uint64)
    if len(b) < n:
        return np.zeros(0, np.uint64)
    powers = np.array([pow(_HASH_BASE, n - 1 - j, 2**64) for j in range(n)], np.uint64)
    windows = np.lib.stride_tricks.sliding_window_view(b, n)
    rows = 1 << 13  # a [rows, n] block of uint64 at a time (4 MiB)
    return np.unique(
        np.concatenate([w @ powers for w in np.split(windows, range(rows, len(windows), rows))])
    )


def document_groups(documents: Mapping[str, bytes], shared_bytes: int = 64) -> list[list[str]]:
    """The documents grouped so that no two groups share a string of ``shared_bytes`` bytes.

    Documents that hold a common ``shared_bytes``-byte string are linked, and the groups are
    the connected components (transitively linked documents). The pydoc topics repeat whole
    sections (``compound`` holds ``for``, ``while``, ``try``, ``with`` and ``class``;
    ``specialnames`` holds ``numeric-types``): a split that keeps each group on one side keeps
    every validation string of that length out of the training text. Strings are compared by a
    64-bit hash; a collision can only join two groups.

    Args:
      documents: ``{name: text}``.
      shared_bytes: the length of a string that links two documents.

    Returns:
      The groups, each a sorted list of names, sorted by their first name.

    Example:
      >>> document_groups({"a": b"x" * 70, "b": b"y" * 70, "c": b"z" + b"x" * 64})
      [['a', 'c'], ['b']]
    """
    _validate.check_int("shared_bytes", shared_bytes, 1)
    names = sorted(documents)
    hashes = [_window_hashes(documents[k], shared_bytes) for k in names]
    owner = np.concatenate([np.full(len(h), i) for i, h in enumerate(hashes)] or [np.zeros(0)])
    flat = np.concatenate(hashes or [np.zeros(0, np.uint64)])
    order = np.argsort(flat, kind="stable")
    flat, owner = flat[order], owner[order].astype(np.int64)
    same = flat[1:] == flat[:-1]  # consecutive owners of one string: an edge
    edges = np.unique(np.stack([owner[:-1][same], owner[1:][same]], 1), axis=0)
    parent = list(range(len(names)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in edges.tolist():
        parent[root(a)] = root(b)
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        groups.setdefault(root(i), []).append(name)
    return sorted(groups.values())


def split_documents(
    documents: Mapping[str, bytes], test_fraction: float, shared_bytes: int = 64
) -> tuple[list[str], list[str]]:
    """A deterministic train/test (validation) split of named documents that shares no text.

    The split's units are the :func:`document_groups` (documents linked by a common
    ``shared_bytes``-byte string stay together). Groups are visited in the order of the
    SHA-256 of their names (joined by newlines) and a group joins the test split if that keeps
    it within twice ``test_fraction`` of all bytes, until the test split holds at least
    ``test_fraction``; everything else is the train split. The order depends on the names
    only, so a group keeps its place when others change (another Python version).

    Args:
      documents: ``{name: text}``.
      test_fraction: the least share of the bytes held out, in (0, 1).
      shared_bytes: see :func:`document_groups`.

    Returns:
      ``(train_names, test_names)``, each sorted.

    Raises:
      ValueError: when no such split exists (fewer than 2 groups, no text, or groups too
        large to reach the fraction without passing twice it or emptying the train split).

    Example:
      >>> split_documents({"a": b"x" * 70, "b": b"y" * 70, "c": b"z" + b"x" * 64}, 0.2)
      (['a', 'c'], ['b'])
    """
    _validate.check_number("test_fraction", test_fraction, gt=0, lt=1)
    groups = document_groups(documents, shared_bytes)
    sizes = [sum(len(documents[k]) for k in g) for g in groups]
    total = sum(sizes)
    order = sorted(
        range(len(groups)),
        key=lambda i: hashlib.sha256("\n".join(groups[i]).encode("utf-8")).hexdigest(),
    )
    test, held = [], 0
    for i in order:
        if held >= test_fraction * total:
            break
        if held + sizes[i] <= 2 * test_fraction * total and len(test) + 1 < len(groups):
            test.append(i)
            held += sizes[i]
    if total == 0 or held < test_fraction * total:
        raise ValueError(
            f"cannot hold out {test_fraction} of {total} bytes in whole groups of documents "
            f"that share no {shared_bytes}-byte string (groups of {sorted(sizes)[-3:]} bytes "
            "among the largest): lower test_fraction or give more documents."
        )
    test_names = sorted(k for i in test for k in groups[i])
    return sorted(set(documents) - set(test_names)), test_names


def unigram_perplexity(train_tokens: np.ndarray, tokens: np.ndarray, vocab_size: int) -> float:
    """Perplexity of ``tokens`` under the unigram model of ``train_tokens`` (add-one smoothed).

    .. math::

      p(v) = \\frac{n_v + 1}{N + V}, \\qquad
      \\mathrm{ppl} = \\exp\\Big(-\\frac{1}{|T|} \\sum_{t \\in T} \\log p(t)\\Big)

    with :math:`n_v` the count of token :math:`v` among the :math:`N` training tokens and
    :math:`V` the vocabulary: the reference a language model must beat (it knows the token
    frequencies and nothing of context). Smoothing gives a token unseen in training a finite
    cost.

    Args:
      train_tokens: the tokens the frequencies are counted on.
      tokens: the tokens scored (e.g. every label of the validation windows).
      vocab_size: :math:`V`; every token must lie in ``[0, V)``.

    Returns:
      The perplexity, a float in ``[1, V]``-ish (``V`` for uniform frequencies).

    Raises:
      ValueError: for an empty ``tokens`` or a token outside the vocabulary.

    Example:
      >>> round(unigram_perplexity(np.array([0, 0, 0, 1]), np.array([0, 1]), 2), 3)
      2.121
    """
    _validate.check_int("vocab_size", vocab_size, 1)
    train_tokens, tokens = np.asarray(train_tokens).ravel(), np.asarray(tokens).ravel()
    if tokens.size == 0:
        raise ValueError("unigram_perplexity needs at least one token to score.")
    for name, t in (("train_tokens", train_tokens), ("tokens", tokens)):
        if not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"{name} must be integer tokens; got dtype {t.dtype}.")
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise ValueError(
                f"{name} must lie in [0, {vocab_size}); got tokens from {t.min()} to {t.max()}."
            )
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - math.log(counts.sum())
    return float(np.exp(-log_p[tokens].mean()))


def token_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of ``seq_len + 1`` tokens, ``[num_windows, seq_len + 1]``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len!r}.")
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens cannot fill one window of {seq_len + 1}.")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens)[idx]


def lm_source(
    windows: np.ndarray, vocab_size: int = 256, info: Mapping[str, Any] | None = None
) -> _sources.ArraySource:
    """Next-token prediction pairs: ``x = w[:, :-1]``, ``label = w[:, 1:]`` (int32); the
    vocabulary (``num_classes``) is ``vocab_size`` (256 byte values by default)."""
    w = windows.astype(np.int32)
    return _sources.ArraySource(
        {"x": w[:, :-1], "label": w[:, 1:]}, num_classes=vocab_size, info=info
    )


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _topics_file() -> dict[str, Any]:
    import pydoc_data.topics

    path = pathlib.Path(pydoc_data.topics.__file__)
    raw = path.read_bytes()
    return {"path": "pydoc_data/topics.py", "bytes": len(raw), "sha256": _digest(raw)}


def pydoc_text(
    split: str = "train",
    *,
    seq_len: int = 128,
    test_fraction: float = 0.1,
    max_train_windows: int | None = None,
    expected_sha256: str | None = None,
) -> _sources.ArraySource:
    """Byte-level language-modelling windows of Python's bundled documentation, split by document.

    The 79 help topics of ``pydoc_data.topics`` (466,117 bytes of UTF-8 English prose on Python
    3.11.7, vocabulary 256 byte values) are split by :func:`split_documents`: the test
    (validation) split holds whole groups of topics that share no 64-byte string with the
    others, at least ``test_fraction`` of the bytes (on 3.11.7: 10 topics, 54,618 bytes,
    11.7%; the topics repeat whole sections of the language reference: held out topic by
    topic, 65% of the validation text's 32-byte pieces occurred in the training text). Each split's
    topics are joined in name order with blank lines and cut into non-overlapping windows of
    ``seq_len + 1`` bytes.

    The source's ``info`` records the corpus's identity (Python version, the file with its size
    and SHA-256, the corpus hash, each split's documents, bytes, hash and windows) and the test
    split's ``unigram_perplexity`` (:func:`unigram_perplexity` of its labels under the train
    split's byte frequencies: 26.06 on 3.11.7 at ``seq_len`` 128), the reference a model is
    measured against.

    Args:
      split: ``"train"`` or ``"test"`` (the validation split).
      seq_len: tokens per example.
      test_fraction: the least share of the corpus's bytes held out, in whole documents.
      max_train_windows: keep only this many windows of the train split, evenly spaced over
        it (``None``: all), for a short run of a per-sample method (AQ-SGD's buffers) that
        must see each sample several times; the test split is unchanged.
      expected_sha256: if given, a different corpus raises ``ValueError``; if ``None``, a
        corpus other than :data:`PYDOC_TOPICS_SHA256` (another Python version) logs a warning.

    Returns:
      An :class:`~jaxcomp.data.ArraySource` with ``x`` and ``label`` of shape ``[seq_len]``
      (int32), and ``info``.

    Example:
      >>> val = pydoc_text("test", seq_len=128)
      >>> val.info["test"]["documents"][:3], len(val)
      (['await', 'bltin-code-objects', 'bltin-null-object'], 426)
    """
    _validate.check_choice("split", split, _sources.SPLITS)
    _validate.check_int("seq_len", seq_len, 1)
    _validate.check_int("max_train_windows", max_train_windows, 1, optional=True)
    docs = pydoc_documents()
    text = SEPARATOR.join(docs.values())
    sha = _digest(text)
    if expected_sha256 is not None and sha != expected_sha256:
        raise ValueError(
            f"pydoc_text corpus has sha256 {sha}, expected {expected_sha256} "
            f"(Python {sys.version.split()[0]} ships different documentation)."
        )
    if expected_sha256 is None and sha != PYDOC_TOPICS_SHA256:
        logging.getLogger(__name__).warning(
            "pydoc_text: corpus sha256 %s differs from the pinned Python 3.11.7 corpus; "
            "results are not comparable across Python versions.",
            sha[:12],
        )
    names = dict(zip(_sources.SPLITS, split_documents(docs, test_fraction)))
    tokens, windows, record = {}, {}, {}
    for part, members in names.items():
        joined = SEPARATOR.join(docs[k] for k in members)
        tokens[part] = np.frombuffer(joined, np.uint8)
        windows[part] = token_windows(tokens[part], seq_len)
        if part == "train" and max_train_windows is not None:
            if max_train_windows > len(windows[part]):
                raise ValueError(
                    f"max_train_windows {max_train_windows} exceeds the "
                    f"{len(windows[part])} windows of the train split at seq_len {seq_len}."
                )
            spread = np.arange(max_train_windows) * len(windows[part]) // max_train_windows
            windows[part] = windows[part][spread]
        record[part] = {
            "documents": members if part == "test" else len(members),
            "bytes": len(joined),
            "sha256": _digest(joined),
            "windows": len(windows[part]),
        }
    info = {
        "name": "pydoc_text",
        "python": sys.version.split()[0],
        "files": [_topics_file()],
        "corpus_bytes": len(text),
        "corpus_sha256": sha,
        "documents": len(docs),
        "seq_len": seq_len,
        "test_fraction": test_fraction,
        "max_train_windows": max_train_windows,
        "split": "by document, in SHA-256 order of the names (jaxcomp.data.split_documents)",
        **record,
        "unigram_perplexity": unigram_perplexity(tokens["train"], windows["test"][:, 1:], 256),
    }
    return lm_source(windows[split], info=info)
