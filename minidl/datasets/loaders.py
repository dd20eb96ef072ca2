"""Image data users have on disk, and a loader that reads it batch by batch.

Two sources (:func:`minidl.datasets.data.load_dataset` names them ``folder``, ``cifar10`` and
``cifar100``):

- :func:`open_folder`: a folder with one sub-folder of images per class (the classes' sorted
  names give the labels 0, 1, ...), any image Pillow reads (``pip install 'minidl[images]'``),
  converted to grey / RGB / RGBA and resized (bilinear) to one (C, H, W). A ``train/`` and
  ``test/`` (or ``val/``) pair of such folders gives the two splits; otherwise a seeded,
  per-class share (default 20 %) is held out as the test split.
- :func:`open_cifar`: CIFAR-10's or CIFAR-100's python batches as downloaded (the fine labels
  of CIFAR-100).

Both give a :class:`StreamedDataset`: its images are an :class:`ImageArray` that reads only the
rows asked for (a folder's files are decoded then; CIFAR stays as uint8 bytes, a quarter of the
float32 arrays) and converts them exactly as the in-memory path does, so every batch is the
same, bit for bit. :class:`Loader` yields :func:`minidl.datasets.data.batches`'s batches, same order
for a (seed, epoch), while a background thread reads the next; :meth:`Trainer.fit
<minidl.train.trainer.Trainer.fit>` uses it for streamed images. Indexing or reading a large folder
prints a line every few seconds (:data:`PROGRESS_EVERY_S`).
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .cifar_files import CIFAR, cifar_root, class_names, read_split
from .dataset import Dataset, adapt_images, batches, num_batches
from .image_folder import (
    index_folder,
    read_shape,
    split_rows,
)
from .image_sources import (
    ArraySource,
    FolderSource,
    check_images,
    image_extensions,
)

#: Seconds between two progress lines while a folder is indexed or read.
PROGRESS_EVERY_S = 5.0


# ----------------------------------------------------------------------------- progress


def _reporter(progress: Any) -> Callable[[str], None] | None:
    if progress is True:
        return lambda line: print(line, file=sys.stderr, flush=True)
    return progress or None


class _Progress:
    """A line every :data:`PROGRESS_EVERY_S` seconds (none for work that ends sooner), and a
    last one when earlier lines were printed."""

    def __init__(self, report: Callable[[str], None] | None) -> None:
        self.report = report
        self.t0 = self.last = time.monotonic()
        self.said = False

    def tick(self, line: Callable[[], str]) -> None:
        if self.report is None:
            return
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last, self.said = now, True
            self.report(f"{line()} ({now - self.t0:.0f} s)")

    def done(self, line: Callable[[], str]) -> None:
        if self.report is not None and self.said:
            self.report(f"{line()} ({time.monotonic() - self.t0:.1f} s)")


# ----------------------------------------------------------------------------- streamed images


class ImageArray:
    """Float32 images (N, C, H, W) read on demand: ``x[i]``, ``x[a:b]``, ``x[rows]`` and
    :meth:`take` read those rows only (uint8 pixels / 255, then fitted to ``shape`` by
    :func:`~minidl.datasets.data.adapt_images` where asked); ``np.asarray(x)`` reads them all. The
    same
    rows always give the same values, bit for bit, however they are batched.

    ``workers`` (default 1): threads decoding a batch's files (a folder's images)."""

    dtype = np.dtype(np.float32)
    ndim = 4

    def __init__(self, source: Any, rows: np.ndarray, shape: tuple[int, int, int] | None = None,
                 scale: float = 255.0) -> None:
        self.source = source
        self.rows = np.asarray(rows, dtype=np.int64)
        self.image_shape = tuple(int(d) for d in (shape or source.shape))
        self.scale = np.float32(scale)
        self.workers = 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.rows), *self.image_shape)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.rows)

    def _convert(self, raw: np.ndarray) -> np.ndarray:
        x = raw.astype(np.float32) / self.scale
        if x.shape[1:] != self.image_shape:
            x = adapt_images(x, self.image_shape)
        return np.ascontiguousarray(x)

    def take(self, positions: Any, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
        """The images at ``positions`` (indices into this array), float32 (k, C, H, W)."""
        return self._convert(self.source.read(self.rows[np.asarray(positions, np.int64)], pool))

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            return self.take(np.arange(len(self))[[key]])[0]
        return self.take(np.arange(len(self))[key])

    def head(self, n: int) -> ImageArray:
        """The first ``n`` images (nothing read)."""
        return self._like(self.rows[:n], self.image_shape)

    def adapted(self, shape: tuple[int, int, int]) -> ImageArray:
        """The same images fitted to ``shape`` (:func:`~minidl.datasets.data.adapt_images`) when
        read."""
        adapt_images(np.zeros((0, *self.image_shape), np.float32), shape)  # (checks the shapes)
        return self._like(self.rows, tuple(int(d) for d in shape))

    def _like(self, rows: np.ndarray, shape: tuple[int, ...]) -> ImageArray:
        other = ImageArray(self.source, rows, shape, float(self.scale))  # type: ignore[arg-type]
        other.workers = self.workers
        return other

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, dtype=np.float32)
        n, chunk = len(self), 256
        what = self.source.describe()
        prog = _Progress(self.source.report)
        pool = ThreadPoolExecutor(self.workers) if self.workers > 1 else None
        try:
            for start in range(0, n, chunk):
                stop = min(start + chunk, n)
                out[start:stop] = self.take(np.arange(start, stop), pool)
                prog.tick(lambda done=stop: f"reading {what}: {done:,} of {n:,} images "
                                            f"({100 * done // max(n, 1)}%)")
        finally:
            if pool is not None:
                pool.shutdown()
        prog.done(lambda: f"read {n:,} images from {what}")
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"ImageArray({self.source.describe()!r}, shape={self.shape})"


class StreamedDataset(Dataset):
    """A :class:`~minidl.datasets.data.Dataset` whose ``x_train`` / ``x_test`` are
    :class:`ImageArray`
    (read batch by batch); :meth:`to_memory` reads them into arrays."""

    def standardize(self) -> None:
        raise ValueError(f"{self.name}: standardising needs the images in memory "
                         "(load_dataset(..., lazy=False), or to_memory())")

    def to_memory(self) -> Dataset:
        """The same dataset with its images read into float32 arrays."""
        return Dataset(np.asarray(self.x_train), self.y_train, np.asarray(self.x_test),
                       self.y_test, self.num_classes, self.input_shape, self.name,
                       adapted_from=self.adapted_from, classes=self.classes)

    def __repr__(self) -> str:
        return "Streamed" + super().__repr__()


# ----------------------------------------------------------------------------- the readers


def open_folder(data_dir: str | os.PathLike, input_shape: tuple[int, int, int] | None = None,
                seed: int = 0, test_fraction: float | None = None,
                progress: Any = True) -> StreamedDataset:
    """A folder of images, one sub-folder per class, as a :class:`StreamedDataset`.

    Layouts: ``DIR/<class>/<image>`` (images at any depth under the class's folder), the test
    split a seeded per-class ``test_fraction`` of them (default 0.2; 0: no test split); or
    ``DIR/train/<class>/...`` with ``DIR/test/<class>/...`` (or ``val/``), the test classes
    among the train ones. Labels: the train classes' sorted folder names (every sub-folder is
    a class). Files whose extension Pillow does not know, and hidden ones, are skipped.

    Images are converted to ``input_shape``'s channels (1: grey, 3: RGB, 4: RGBA) and resized
    (bilinear) to its height and width; the default is the first image's size, grey or RGB
    by its mode. Pixels are scaled to [0, 1] (uint8 / 255). Both splits come in a seeded random
    order (so the first n are a random sample).
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    exts = image_extensions()
    report = _reporter(progress)
    found = index_folder(root, exts, _Progress(report))
    check_images(found.paths, _Progress(report))  # (a damaged image: refused now, not later)
    tr, te = split_rows(found, seed, test_fraction)
    shape = read_shape(input_shape, found.paths[0])
    source = FolderSource(found.paths, shape, root, report)
    labels = found.labels
    return StreamedDataset(ImageArray(source, tr), labels[tr], ImageArray(source, te),
                           labels[te], len(found.classes), shape, "folder",
                           classes=tuple(found.classes))


def open_cifar(data_dir: str | os.PathLike, name: str = "cifar10",
               progress: Any = True) -> StreamedDataset:
    """CIFAR-10 (``name="cifar10"``: ``data_batch_1`` .. ``data_batch_5``, ``test_batch``,
    ``batches.meta``) or CIFAR-100 (``"cifar100"``: ``train``, ``test``, ``meta``; the 100
    fine labels) from the python batches in ``data_dir`` or in its ``cifar-10-batches-py`` /
    ``cifar-100-python`` folder, as a :class:`StreamedDataset` of 3x32x32 images in [0, 1]
    (kept as uint8 and converted batch by batch). The splits keep the files' order."""
    if name not in CIFAR:
        raise ValueError(f"unknown CIFAR dataset {name!r}; valid: {', '.join(CIFAR)}")
    fmt = CIFAR[name]
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{fmt.title} folder {data_dir} does not exist")
    root = cifar_root(data_dir, fmt, name)
    prog = _Progress(_reporter(progress))
    x_train, y_train = read_split(root, fmt.train, fmt, prog)
    x_test, y_test = read_split(root, fmt.test, fmt, prog)
    classes = class_names(root, fmt)
    source = ArraySource(np.concatenate([x_train, x_test]), str(root))
    n = len(x_train)
    return StreamedDataset(ImageArray(source, np.arange(n)), y_train,
                           ImageArray(source, n + np.arange(len(x_test))), y_test,
                           fmt.num_classes, (3, 32, 32), name, classes=classes)


# ----------------------------------------------------------------------------- the loader


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


class Loader:
    """The batches of ``batches(x, y, batch_size, shuffle, seed, epoch, drop_last)``
    (:func:`minidl.datasets.data.batches`: same order, same float32 / int64 arrays, bit for bit)
    from
    batch ``start`` on, each read while the one before is used: a background thread keeps
    ``prefetch`` batches ready (0: read in the caller's thread). ``x`` is an
    :class:`ImageArray` (only each batch's rows are read; ``workers`` threads decode a batch's
    files, default ``x.workers``) or an array. An error reading a batch is raised where that
    batch is drawn. Stop early with ``close()`` on the iterator (or by dropping it)."""

    def __init__(self, x: Any, y: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
                 epoch: int = 0, drop_last: bool = False, *, start: int = 0, prefetch: int = 1,
                 workers: int | None = None) -> None:
        n = len(x)
        if len(y) != n:
            raise ValueError(f"x has {n} samples but y has {len(y)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if start < 0 or prefetch < 0:
            raise ValueError(f"start and prefetch must be >= 0, got {start} and {prefetch}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.seed, self.epoch, self.drop_last = shuffle, seed, epoch, drop_last
        self.start, self.prefetch = start, prefetch
        self.workers = workers if workers is not None else getattr(x, "workers", 1)

    def __len__(self) -> int:
        return max(0, num_batches(len(self.x), self.batch_size, self.drop_last) - self.start)

    def _jobs(self) -> list[Any]:
        n, bs = len(self.x), self.batch_size
        order = np.random.default_rng([self.seed, self.epoch]).permutation(n) \
            if self.shuffle else None
        stop = n - n % bs if self.drop_last else n
        return [order[s:min(s + bs, n)] if order is not None else slice(s, min(s + bs, n))
                for s in range(self.start * bs, stop, bs)]

    def _read(self, job: Any, pool: ThreadPoolExecutor | None) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.x, self.y
        if isinstance(job, slice):
            if isinstance(x, ImageArray):
                xb = x.take(np.arange(job.start, job.stop), pool)
            else:
                xb = np.array(x[job], dtype=np.float32, order="C", copy=True)
            return xb, np.array(y[job], dtype=np.int64, order="C", copy=True)
        xb = x.take(job, pool) if isinstance(x, ImageArray) else np.ascontiguousarray(
            x[job], dtype=np.float32)
        return xb, np.ascontiguousarray(y[job], dtype=np.int64)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self._run()

    def _run(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        jobs = self._jobs()
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="minidl-decode") \
            if self.workers > 1 and isinstance(self.x, ImageArray) else None
        try:
            if self.prefetch == 0:
                for job in jobs:
                    yield self._read(job, pool)
                return
            yield from self._prefetched(jobs, pool)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)

    def _prefetched(self, jobs: list[Any], pool: ThreadPoolExecutor | None
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        def produce() -> None:
            try:
                for job in jobs:
                    if stop.is_set() or not put(self._read(job, pool)):
                        return
            except BaseException as e:  # raised where the batch is drawn
                put(_Failed(e))
                return
            put(_END)

        thread = threading.Thread(target=produce, name="minidl-loader", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            stop.set()
            thread.join()


def epoch_batches(x: Any, y: Any, batch_size: int, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, start: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch's batches from batch ``start`` on (what :meth:`Trainer.fit
    <minidl.train.trainer.Trainer.fit>` draws): a prefetching :class:`Loader` for an
    :class:`ImageArray` (the skipped batches not read), :func:`minidl.datasets.data.batches` for
    arrays. Close it (``close()``) when stopping early."""
    if isinstance(x, ImageArray):
        yield from Loader(x, y, batch_size, shuffle, seed, epoch, start=start)
    else:
        yield from itertools.islice(batches(x, y, batch_size, shuffle=shuffle, seed=seed,
                                            epoch=epoch), start, None)
