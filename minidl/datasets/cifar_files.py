"""CIFAR-10's and CIFAR-100's python batches as downloaded: where they are, their files read
by an unpickler that loads arrays, bytes, lists and dicts only, checked batch by batch."""

from __future__ import annotations

import codecs
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .image_sources import ImageReadError, ProgressLines


@dataclass(frozen=True)
class CifarFormat:
    """The files and keys of one CIFAR's python batches."""

    title: str
    folder: str
    archive: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    meta: str
    labels: bytes
    names: bytes
    num_classes: int


CIFAR = {
    "cifar10": CifarFormat("CIFAR-10", "cifar-10-batches-py", "cifar-10-python.tar.gz",
                            tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",),
                            "batches.meta", b"labels", b"label_names", 10),
    "cifar100": CifarFormat("CIFAR-100", "cifar-100-python", "cifar-100-python.tar.gz",
                             ("train",), ("test",), "meta", b"fine_labels", b"fine_label_names",
                             100),
}

# What a CIFAR batch pickles besides dicts, lists, bytes and numbers: NumPy arrays (Python 2's
# and 3's numpy.core / numpy._core, protocols 2 to 5) and Python 3 bytes under protocol 2.
_PICKLED = {
    "_reconstruct": np.zeros(1).__reduce__()[0],
    "_frombuffer": np.zeros(1).__reduce_ex__(5)[0],
    "scalar": np.float64(0).__reduce__()[0],
    "ndarray": np.ndarray,
    "dtype": np.dtype,
}
_PICKLED_MODULES = {"numpy", "numpy.core.multiarray", "numpy._core.multiarray",
                    "numpy.core.numeric", "numpy._core.numeric"}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles arrays, bytes, lists and dicts only (no other code a file could name)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _PICKLED_MODULES and name in _PICKLED:
            return _PICKLED[name]
        if (module, name) == ("_codecs", "encode"):
            return codecs.encode
        raise pickle.UnpicklingError(f"it pickles {module}.{name}")


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise ImageReadError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:
        raise ImageReadError(f"{path}: not a CIFAR python batch ({e})") from None
    if not isinstance(d, dict):
        raise ImageReadError(f"{path}: not a CIFAR python batch (it holds a "
                             f"{type(d).__name__}, not a dict)")
    return {k.encode() if isinstance(k, str) else k: v for k, v in d.items()}


def cifar_root(data_dir: Path, fmt: CifarFormat, name: str) -> Path:
    """The folder holding the batches: ``data_dir`` or its ``fmt.folder``; else
    ``FileNotFoundError``, with a hint where the archive or the other CIFAR is there."""
    files = fmt.train + fmt.test
    for cand in (data_dir, data_dir / fmt.folder):
        if all((cand / f).is_file() for f in files):
            return cand
    hint = ""
    for cand in (data_dir, data_dir.parent):
        if (cand / fmt.archive).is_file():
            hint = f" ({cand / fmt.archive} is there: extract it with tar xzf)"
    for other_name, other in CIFAR.items():
        if other_name != name and any(all((c / f).is_file() for f in other.train + other.test)
                                      for c in (data_dir, data_dir / other.folder)):
            hint = f" (it holds {other.title}: --dataset {other_name})"
    listing = ", ".join(files) if len(files) < 4 else f"{files[0]}..{len(fmt.train)}, " \
        f"{fmt.test[0]}"
    raise FileNotFoundError(f"{data_dir}: no {fmt.title} python batches ({listing}) "
                            f"there or in {data_dir / fmt.folder}{hint}")


def read_split(root: Path, files: tuple[str, ...], fmt: CifarFormat,
                 prog: ProgressLines) -> tuple[np.ndarray, np.ndarray]:
    """The images (uint8 (N, 3, 32, 32)) and labels of one split's batch files, checked."""
    xs, ys = [], []
    for k, f in enumerate(files):
        path = root / f
        d = _unpickle(path)
        data, labels = d.get(b"data"), d.get(fmt.labels)
        if not isinstance(data, np.ndarray) or labels is None:
            raise ImageReadError(f"{path}: not a {fmt.title} batch (no "
                                 f"{'data' if not isinstance(data, np.ndarray) else 'labels'} "
                                 f"array{'' if labels is not None else ', ' + fmt.labels.decode()}"
                                 ")")
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
            raise ImageReadError(f"{path}: data is {data.dtype} {data.shape}, not uint8 "
                                 "(N, 3072) (32x32 RGB rows)")
        y = np.asarray(labels, dtype=np.int64).reshape(-1)
        if len(y) != len(data):
            raise ImageReadError(f"{path}: {len(data)} images but {len(y)} labels")
        if y.size and (y.min() < 0 or y.max() >= fmt.num_classes):
            raise ImageReadError(f"{path}: labels outside [0, {fmt.num_classes})")
        xs.append(data.reshape(-1, 3, 32, 32))
        ys.append(y)
        prog.tick(lambda k=k: f"reading {root}: {k + 1} of {len(files)} files")
    return np.concatenate(xs), np.concatenate(ys)


def class_names(root: Path, fmt: CifarFormat) -> tuple[str, ...] | None:
    """The class names the meta file holds (None: no meta file, or not one name a class)."""
    if (root / fmt.meta).is_file():
        names = _unpickle(root / fmt.meta).get(fmt.names)
        if isinstance(names, list) and len(names) == fmt.num_classes:
            return tuple(n.decode() if isinstance(n, bytes) else str(n) for n in names)
    return None
