"""Datasets in memory and their batches: :class:`Dataset` (train and test splits),
:func:`batches` (the shuffled order every loader follows), fitting images to a shape
(:func:`adapt_images`), a seeded stratified split and random shifts. The loaders of named
datasets are :mod:`minidl.datasets.data` (and :mod:`minidl.datasets.loaders` for streamed ones)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel mean and standard deviation of images."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass
class Dataset:
    """Train and test splits: ``x_*`` float32 (N, C, H, W), ``y_*`` int64 (N,).

    ``input_shape`` is (C, H, W); ``num_classes`` the number of model outputs the labels
    index into (labels lie in ``[0, num_classes)``).
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    input_shape: tuple[int, int, int]
    name: str
    #: Per-channel statistics of the train images that :meth:`standardize` took out
    #: (``None`` while the images are as loaded).
    standardization: ChannelStats | None = None
    #: The images' own (C, H, W) when ``input_shape`` asked for another and they were fitted to
    #: it (:func:`adapt_images`); :meth:`adaptation` says how.
    adapted_from: tuple[int, int, int] | None = None
    #: The classes' names, label order (folders and CIFAR; ``None`` where the data has none).
    classes: tuple[str, ...] | None = None

    def adaptation(self) -> str:
        """How the images were fitted to ``input_shape`` ("" when they were not)."""
        if self.adapted_from is None:
            return ""
        (c, h, w), (C, H, W) = self.adapted_from, self.input_shape
        parts = []
        if (h, w) != (H, W):
            how = ("zero-padded" if H >= h and W >= w else "cropped" if H <= h and W <= w
                   else "cropped and zero-padded")
            parts.append(f"centre {how} to {H}x{W}")
        if c != C:
            parts.append(f"the channel repeated {C} times" if c == 1
                         else f"the {c} channels averaged into {C}")
        return f"{self.name} images of {c}x{h}x{w} " + " and ".join(parts)

    def __post_init__(self) -> None:
        self.input_shape = tuple(int(d) for d in self.input_shape)  # type: ignore[assignment]
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if x.dtype != np.float32 or y.dtype != np.int64:
                raise TypeError(f"{self.name}: x_{split} must be float32 and y_{split} int64, "
                                f"got {x.dtype} and {y.dtype}")
            if x.shape[1:] != self.input_shape or y.shape != (x.shape[0],):
                raise ValueError(f"{self.name}: x_{split} {x.shape} / y_{split} {y.shape} do not "
                                 f"match input_shape {self.input_shape}")

    def standardize(self) -> None:
        """Give each channel zero mean and unit variance, with the statistics of the train
        images only (the test images get the same transform, so nothing is learnt from them);
        records them in ``standardization``. A blank pixel (0) becomes ``-mean / std``."""
        if self.standardization is not None:
            raise ValueError(f"{self.name} is already standardised "
                             f"(mean {self.standardization.mean})")
        if self.n_train == 0:
            raise ValueError(f"{self.name}: no train images to take statistics from")
        axes = (0, 2, 3)
        mean = self.x_train.mean(axis=axes, dtype=np.float64)
        std = self.x_train.std(axis=axes, dtype=np.float64)
        std[std == 0] = 1.0
        shape = (1, -1, 1, 1)
        m, s = mean.astype(np.float32).reshape(shape), std.astype(np.float32).reshape(shape)
        self.x_train = (self.x_train - m) / s
        self.x_test = (self.x_test - m) / s
        self.standardization = ChannelStats(tuple(float(v) for v in mean),
                                            tuple(float(v) for v in std))

    @property
    def background(self) -> tuple[float, ...]:
        """Per channel, the value a blank (0) pixel has now: ``-mean / std`` once
        standardised, 0 before."""
        if self.standardization is None:
            return (0.0,) * self.input_shape[0]
        st = self.standardization
        return tuple(-m / s for m, s in zip(st.mean, st.std))

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={self.n_train}, test={self.n_test}, "
                f"input_shape={self.input_shape}, num_classes={self.num_classes})")


# ----------------------------------------------------------------------------- helpers


def stratified_indices(y: np.ndarray, test_fraction: float,
                       seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded, per-class split of the samples labelled ``y``: (train rows, test rows), each in
    a seeded random order; ``round(test_fraction * n_c)`` of each class's ``n_c`` go to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train_idx, test_idx = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_test = int(round(len(idx) * test_fraction))
        test_idx.append(idx[:n_test])
        train_idx.append(idx[n_test:])
    tr = rng.permutation(np.concatenate(train_idx))
    te = rng.permutation(np.concatenate(test_idx))
    return tr, te


def adapt_images(x: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """Fit images (N, c, h, w) to ``shape`` = (C, H, W).

    Spatially: centre crop where the target is smaller, centre zero-pad where it is larger
    (an odd remainder goes after). Channels: 1 -> C repeats the channel, 3 -> 1 averages;
    other channel changes raise ``ValueError``. Returns a new contiguous float32 array.
    """
    if x.ndim != 4 or len(shape) != 3:
        raise ValueError(f"expected images (N, C, H, W) and a (C, H, W) shape, "
                         f"got {x.shape} and {tuple(shape)}")
    n, c, h, w = x.shape
    C, H, W = (int(d) for d in shape)
    if min(C, H, W) < 1:
        raise ValueError(f"bad target shape {tuple(shape)}")
    if c == C:
        src = x
    elif c == 1:
        src = x  # broadcast over channels when copying below
    elif c == 3 and C == 1:
        src = x.mean(axis=1, keepdims=True, dtype=np.float32)
    else:
        raise ValueError(f"cannot adapt {c} channels to {C} (only 1->C and 3->1 are supported)")

    def window(have: int, want: int) -> tuple[slice, slice]:
        if want >= have:  # pad: whole source into the middle of the target
            before = (want - have) // 2
            return slice(0, have), slice(before, before + have)
        start = (have - want) // 2  # crop: middle of the source
        return slice(start, start + want), slice(0, want)

    (sh, dh), (sw, dw) = window(h, H), window(w, W)
    out = np.zeros((n, C, H, W), dtype=np.float32)
    out[:, :, dh, dw] = src[:, :, sh, sw]
    return out


# ----------------------------------------------------------------------------- loaders


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches :func:`batches` yields for ``n`` samples."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return n // batch_size if drop_last else -(-n // batch_size)


def random_shift(x: np.ndarray, rng: np.random.Generator, probability: float = 1.0,
                 fill: float | tuple[float, ...] = 0.0) -> np.ndarray:
    """Images ``x`` (N, C, H, W), each moved with ``probability`` by (dy, dx) drawn uniformly
    from {-1, 0, 1}^2; the row and column it uncovers get ``fill`` (a value, or one per
    channel). Returns a new array; the others are copied unchanged."""
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {probability}")
    n, c, h, w = x.shape
    padded = np.empty((n, c, h + 2, w + 2), dtype=x.dtype)
    padded[...] = np.asarray(fill, dtype=x.dtype).reshape(-1, 1, 1) if np.ndim(fill) else fill
    padded[:, :, 1:-1, 1:-1] = x
    moved = rng.random(n) < probability
    dy = np.where(moved, rng.integers(-1, 2, n), 0)
    dx = np.where(moved, rng.integers(-1, 2, n), 0)
    # Output pixel (i, j) is input pixel (i - dy, j - dx), at (i - dy + 1, j - dx + 1) padded.
    rows = (np.arange(h) + 1 - dy[:, None])[:, None, :, None]
    cols = (np.arange(w) + 1 - dx[:, None])[:, None, None, :]
    return np.ascontiguousarray(
        padded[np.arange(n)[:, None, None, None], np.arange(c)[None, :, None, None], rows, cols])


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, shuffle: bool = True, seed: int = 0,
            epoch: int = 0, drop_last: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(x_batch, y_batch)`` as fresh contiguous float32 / int64 arrays.

    With ``shuffle`` the order is ``np.random.default_rng([seed, epoch]).permutation(len(x))``:
    deterministic for a (seed, epoch) pair and different across epochs. The last, smaller
    batch is yielded unless ``drop_last``.
    """
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x has {n} samples but y has {len(y)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else None
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        sel = slice(start, min(start + batch_size, n))
        if order is not None:  # fancy indexing already copies
            idx = order[sel]
            yield (np.ascontiguousarray(x[idx], dtype=np.float32),
                   np.ascontiguousarray(y[idx], dtype=np.int64))
        else:
            yield (np.array(x[sel], dtype=np.float32, order="C", copy=True),
                   np.array(y[sel], dtype=np.int64, order="C", copy=True))
