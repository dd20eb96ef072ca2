"""Named workspace layouts (llm.c style): one record of the buffers a kernel or layer carves
from its workspace, used both to size the workspace and to carve it, so every buffer is
reached by name and the two can never disagree.

Buffers are laid out in declaration order, each 64-byte aligned; a nested layout (or a tuple
of them, e.g. one per worker thread) occupies its place in that order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

_ALIGN = 64

Shape = tuple[int, ...]
Entry = Union[Shape, "Layout", tuple["Layout", ...]]


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // _ALIGN) * _ALIGN


def workspace_bytes(dtype, *shapes) -> int:
    """Bytes of a workspace holding one array of ``dtype`` per shape, each 64-byte aligned."""
    item = np.dtype(dtype).itemsize
    return sum(_aligned(math.prod(s) * item) for s in shapes)


def workspace_views(workspace, dtype, *shapes) -> list:
    """Arrays of ``shapes`` carved in order from a 1-D uint8 ``workspace`` (see
    :func:`workspace_bytes`); their contents are undefined."""
    dt = np.dtype(dtype)
    views, off = [], 0
    for s in shapes:
        n = math.prod(s) * dt.itemsize
        views.append(workspace[off:off + n].view(dt).reshape(s))
        off += _aligned(n)
    return views


class Buffers(Mapping):
    """The arrays carved from a workspace by a :class:`Layout`, by name: ``ws.name`` or
    ``ws["name"]``; a nested layout gives a :class:`Buffers`, a tuple of layouts a tuple."""

    __slots__ = ("_arrays",)

    def __init__(self, arrays: dict[str, Any]) -> None:
        object.__setattr__(self, "_arrays", arrays)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._arrays[name]
        except KeyError:
            raise AttributeError(f"no workspace buffer named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("workspace buffers are read-only")

    def __getitem__(self, name: str) -> Any:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


@dataclass(frozen=True)
class Layout:
    """Ordered named buffers: each entry is a shape, a nested :class:`Layout` or a tuple of
    them. Build one with :meth:`of` (keyword order is byte order)."""

    entries: tuple[tuple[str, Entry], ...]

    @classmethod
    def of(cls, **entries: Entry) -> Layout:
        return cls(tuple((name, _freeze(entry)) for name, entry in entries.items()))

    def shapes(self) -> list[Shape]:
        """Every array's shape, in byte order."""
        out: list[Shape] = []
        for _, entry in self.entries:
            for sub in _sublayouts(entry):
                if sub is None:
                    out.append(entry)
                else:
                    out.extend(sub.shapes())
        return out

    def nbytes(self, dtype) -> int:
        """Workspace bytes of this layout for ``dtype`` elements."""
        return workspace_bytes(dtype, *self.shapes())

    def carve(self, workspace, dtype) -> Buffers:
        """The named arrays of this layout in ``workspace`` (1-D uint8 of at least
        :meth:`nbytes`); their contents are undefined."""
        return self._build(iter(workspace_views(workspace, dtype, *self.shapes())))

    def _build(self, arrays: Iterator[np.ndarray]) -> Buffers:
        out: dict[str, Any] = {}
        for name, entry in self.entries:
            if isinstance(entry, Layout):
                out[name] = entry._build(arrays)
            elif entry and isinstance(entry[0], Layout):
                out[name] = tuple(sub._build(arrays) for sub in entry)
            else:
                out[name] = next(arrays)
        return Buffers(out)


def _freeze(entry: Any) -> Entry:
    if isinstance(entry, Layout):
        return entry
    entry = tuple(entry)
    if entry and isinstance(entry[0], Layout):
        if not all(isinstance(e, Layout) for e in entry):
            raise TypeError("a tuple of layouts cannot mix in shapes")
        return entry
    return tuple(int(d) for d in entry)


def _sublayouts(entry: Entry) -> list[Layout | None]:
    """The layouts an entry stands for ([None] for a plain shape)."""
    if isinstance(entry, Layout):
        return [entry]
    if entry and isinstance(entry[0], Layout):
        return list(entry)
    return [None]
