"""A folder of images, one sub-folder per class: its layout (``train/`` and ``test/`` or
``val/``, or the classes alone), the index of its image files with their labels, the rows of
each split and the shape the images are read at."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .dataset import stratified_indices
from .image_sources import MODES, ProgressLines, default_shape

#: The share of each class a folder without test/ holds out as its test split.
DEFAULT_TEST_FRACTION = 0.2
#: The fewest train images a folder may hold (one image is no dataset: a typo'd --data-dir).
MIN_TRAIN_IMAGES = 2


@dataclass
class FolderIndex:
    """The image files of a folder and their labels: the train split's first (``n_train``),
    then the test folder's (when the folder has one, ``test_root``)."""

    root: Path
    train_root: Path
    test_root: Path | None
    classes: list[str]
    paths: list[str]
    labels: np.ndarray
    n_train: int


def _subdirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _index(root: Path, classes: list[str], labels: list[int], exts: set[str],
           paths: list[str], ys: list[int], prog: ProgressLines) -> None:
    """Append the images under ``root/<class>/`` (any depth, sorted) to ``paths`` / ``ys``."""
    for k, (cls, label) in enumerate(zip(classes, labels)):
        for top, dirs, files in os.walk(root / cls, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in sorted(files):
                if not f.startswith(".") and os.path.splitext(f)[1].lower() in exts:
                    paths.append(os.path.join(top, f))
                    ys.append(label)
            prog.tick(lambda k=k: f"indexing {root}: {len(paths):,} images so far, class "
                                  f"{k + 1} of {len(classes)}")


def _folder_layout(root: Path) -> tuple[Path, Path | None]:
    """(train root, test root or None): ``train/`` + ``test/`` (or ``val/``) when the folder
    holds those alone, else the folder itself with no test root."""
    subs = _subdirs(root)
    if "train" in subs and set(subs) <= {"train", "test", "val"}:
        test = "test" if "test" in subs else "val" if "val" in subs else None
        return root / "train", None if test is None else root / test
    return root, None


def index_folder(root: Path, exts: set[str], prog: ProgressLines) -> FolderIndex:
    """The images (extensions ``exts``) of the folder ``root`` by class, the train classes'
    sorted names giving the labels; ``ValueError`` for a folder without classes or train
    images, or a test class the train split lacks."""
    train_root, test_root = _folder_layout(root)
    classes = _subdirs(train_root)
    if not classes:
        raise ValueError(f"{train_root}: no class sub-folders (the layout is "
                         f"{train_root}/<class>/<image>, one folder per class)")
    paths: list[str] = []
    ys: list[int] = []
    _index(train_root, classes, list(range(len(classes))), exts, paths, ys, prog)
    n_train = len(paths)
    if test_root is not None:
        test_classes = _subdirs(test_root)
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise ValueError(f"{test_root}: class folder(s) {', '.join(map(repr, unknown[:5]))} "
                             f"not among the {len(classes)} classes of {train_root}")
        _index(test_root, test_classes, [classes.index(c) for c in test_classes], exts, paths,
               ys, prog)
    prog.done(lambda: f"indexed {root}: {len(paths):,} images in {len(classes)} classes")
    if n_train == 0:
        raise ValueError(f"{train_root}: no images in its {len(classes)} class folder(s) "
                         f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
    counts = np.bincount(np.asarray(ys[:n_train], dtype=np.int64), minlength=len(classes))
    empty = [c for c, n in zip(classes, counts) if n == 0]
    if empty:  # (a class no image teaches: an output the model could never learn)
        raise ValueError(f"{train_root}: class folder(s) {', '.join(map(repr, empty[:5]))}"
                         f"{' ...' if len(empty) > 5 else ''} hold no images (of "
                         f"{', '.join(sorted(exts)[:6])}, ...): every class needs images to "
                         "train on; remove the empty folder(s) or fill them")
    if n_train < MIN_TRAIN_IMAGES:
        raise ValueError(f"{train_root}: {n_train} image in {len(classes)} class folder(s); a "
                         f"folder dataset needs at least {MIN_TRAIN_IMAGES} to train on")
    return FolderIndex(root, train_root, test_root, classes, paths,
                       np.asarray(ys, dtype=np.int64), n_train)


def split_rows(found: FolderIndex, seed: int, test_fraction: float | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The rows of the train and test splits, each in a seeded random order: the test
    folder's images, or a seeded per-class ``test_fraction`` (default
    :data:`DEFAULT_TEST_FRACTION`; 0: none) held out of a folder without one."""
    n_train, n = found.n_train, len(found.paths)
    rng = np.random.default_rng(seed)
    if found.test_root is not None:
        if test_fraction is not None:
            raise ValueError(f"{found.root} has its own test split ({found.test_root.name}/): "
                             "test_fraction applies to a folder without one")
        return rng.permutation(n_train), n_train + rng.permutation(n - n_train)
    f = DEFAULT_TEST_FRACTION if test_fraction is None else float(test_fraction)
    if not 0.0 <= f < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    return (stratified_indices(found.labels, f, seed) if f > 0
            else (rng.permutation(n_train), np.zeros(0, np.int64)))


def read_shape(input_shape: Any, first_image: str) -> tuple[int, int, int]:
    """The (C, H, W) a folder's images are read at: ``input_shape``, checked, else the first
    image's size, grey or RGB by its mode."""
    if input_shape is None:
        return default_shape(first_image)
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3 or shape[0] not in MODES or min(shape) < 1:
        raise ValueError(f"folder images are read as 1 (grey), 3 (RGB) or 4 (RGBA) channels "
                         f"of at least 1x1 pixels, not {'x'.join(map(str, shape))}")
    return shape  # type: ignore[return-value]
