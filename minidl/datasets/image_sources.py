"""Where a streamed dataset's pixels come from: image files decoded by Pillow when a batch
needs them (:class:`FolderSource`), or uint8 images kept in memory (:class:`ArraySource`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np

PILLOW_HINT = "pip install 'minidl[images]'"

#: Pillow modes read as one grey channel when the shape is the first image's.
_GREY_MODES = {"1", "L", "LA", "La", "I", "I;16", "I;16L", "I;16B", "I;16N", "F"}
#: The Pillow mode each channel count converts images to.
MODES = {1: "L", 3: "RGB", 4: "RGBA"}


class ProgressLines(Protocol):
    """What reading a folder or CIFAR's files reports its progress to (``minidl.datasets.
    loaders``' clock: a line every few seconds)."""

    def tick(self, line: Callable[[], str]) -> None: ...

    def done(self, line: Callable[[], str]) -> None: ...


class ImageReadError(OSError):
    """An image file or a CIFAR batch that cannot be read (the message names it)."""


def pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(f"the 'folder' dataset needs Pillow: {PILLOW_HINT}") from None
    return Image


def _why(e: Exception) -> str:
    if type(e).__name__ == "UnidentifiedImageError":  # (its message repeats the path)
        return "not an image Pillow can identify (damaged, or a format it does not read)"
    return str(e) or type(e).__name__


def image_extensions() -> set[str]:
    """The file extensions of the formats Pillow reads (not those it only writes: .pdf)."""
    Image = pillow()
    return {ext.lower() for ext, fmt in Image.registered_extensions().items()
            if fmt in Image.OPEN}


def default_shape(path: str) -> tuple[int, int, int]:
    """The (C, H, W) of the image at ``path``: its size, grey or RGB by its mode."""
    Image = pillow()
    try:
        with Image.open(path) as im:
            w, h = im.size
            return (1 if im.mode in _GREY_MODES else 3, h, w)
    except Exception as e:
        raise ImageReadError(f"cannot read image {path}: {_why(e)}") from None


def check_images(paths: list[str], prog: ProgressLines) -> None:
    """Every image file read through once while the folder is indexed (Pillow's ``verify``:
    the header, a PNG's every chunk; a truncated or damaged file fails), so that a bad image
    is refused before training, not met in a later epoch. ``ImageReadError`` names it."""
    Image = pillow()
    for k, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                im.verify()
        except Exception as e:  # (Pillow raises OSError, SyntaxError, struct.error ...)
            raise ImageReadError(f"cannot read image {path}: {_why(e)}") from None
        prog.tick(lambda k=k: f"checking {len(paths):,} images: {k + 1:,} read")
    prog.done(lambda: f"checked {len(paths):,} images")


class FolderSource:
    """Image files, each decoded to uint8 (C, H, W) when read."""

    def __init__(self, paths: list[str], shape: tuple[int, int, int], root: Path,
                 report: Callable[[str], None] | None) -> None:
        self.paths, self.shape, self.root, self.report = paths, shape, root, report
        self.mode = MODES[shape[0]]

    def read_one(self, i: int) -> np.ndarray:
        Image = pillow()
        path = self.paths[i]
        _, h, w = self.shape
        try:
            with Image.open(path) as im:
                im = im.convert(self.mode) if im.mode != self.mode else im
                if im.size != (w, h):
                    im = im.resize((w, h), Image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.uint8)
        except Exception as e:  # (Pillow raises OSError, ValueError, DecompressionBombError...)
            raise ImageReadError(f"cannot read image {path}: {_why(e)}") from None
        return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)

    def read(self, rows: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
        out = np.empty((len(rows), *self.shape), dtype=np.uint8)
        images = pool.map(self.read_one, rows.tolist()) if pool else map(self.read_one, rows)
        for k, image in enumerate(images):
            out[k] = image
        return out

    def describe(self) -> str:
        return str(self.root)


class ArraySource:
    """uint8 images (N, C, H, W) in memory."""

    def __init__(self, images: np.ndarray, name: str) -> None:
        self.images, self.name, self.shape, self.report = images, name, images.shape[1:], None

    def read(self, rows: np.ndarray, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
        return self.images[rows]

    def describe(self) -> str:
        return self.name
