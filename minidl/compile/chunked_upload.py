"""Chunks for ``offload=optimizer``'s copy back (PatrickStar's / Gemini's chunks): the updated
master weights of parameters whose device blocks lie back to back, as the host's do, go to the
device as one transfer of at most :data:`UPLOAD_CHUNK_BYTES` (a larger block alone) instead of
one transfer per parameter.

Measured with benchmarks/offload/transfer_chunks.py (2 shared cores, 2026-11-29):
each of GPT-2 small's 148 parameters its own transfer costs 5-9 % of the copy back on this
machine's emulated link against 0-1 % in 32 MiB chunks (in real offload steps of a GPT with
those 148 tensors at width 256: 0.7-2.8 % against 0.0-0.1 %), and 2-7 % on an A100 / H100 with
a 5 us per-transfer latency (the cost model itself has no per-transfer term). A parameter the
device keeps only as its half copy (mixed precision) is rounded from its float32 master on the
way and still goes alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..memory.runtime.transfer import copy_into
from ..net.parameter import Parameter

__all__ = ["UPLOAD_CHUNK_BYTES", "ChunkedUpload"]

#: The largest transfer chunks are grouped into (a larger parameter is one transfer alone).
UPLOAD_CHUNK_BYTES = 32 << 20


class ChunkedUpload:
    """The copy back of a :class:`~.host_state.HostState` (``state``) in chunks: ``chunks``
    (device offset, master offset, bytes) and the parameters copied alone (``rest``: half
    copies, or parameters without a device block of their own). ``device_offsets``: each
    parameter's block offset in the device's arena, by name."""

    def __init__(self, state: Any, device_offsets: dict[str, int],
                 chunk_bytes: int = UPLOAD_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunks: list[tuple[int, int, int]] = []
        self.rest: list[Parameter] = []
        run: list[int] | None = None  # [device offset, master offset, bytes]
        for p in state.params:
            offset, size = state.offsets[p.name]
            device = device_offsets.get(p.name)
            if p.name in state.half_copies or device is None:
                self.rest.append(p)
                continue
            if run is not None and run[0] + run[2] == device and run[1] + run[2] == offset \
                    and run[2] + size <= chunk_bytes:
                run[2] += size
                continue
            if run is not None:
                self.chunks.append((run[0], run[1], run[2]))
            run = [device, offset, size]
        if run is not None:
            self.chunks.append((run[0], run[1], run[2]))

    def upload(self, device: Any, master: Any, engine: Any) -> list[Parameter]:
        """Copy every chunk from the host's ``master`` bytes into ``device``'s arena (queued on
        ``engine`` when given, else at once); the parameters left to copy one by one."""
        for at, offset, nbytes in self.chunks:
            dst = device.view(at, nbytes, (nbytes,), np.uint8)
            src = master[offset:offset + nbytes]
            if engine is None:
                copy_into(dst, src)
            else:
                engine.copy_async(dst, src)
        return self.rest
