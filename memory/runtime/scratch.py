"""The device library's own temporaries (CuPy's) during a run: where their bytes come from.

A GPU step makes a few arrays the plan does not know (reduction results, index vectors). They
are routed into the arena (:meth:`~.cuda_device.CudaDevice.route_allocations`) by
:class:`TemporaryRouter`:

* with a scratch block reserved (``scratch = (offset, bytes)``, a persistent block the engine
  sizes once measured), they come from a sub-pool over that block, so they never disturb the
  plan's placement; one that does not fit there (another program, e.g. an evaluation at a
  larger batch, makes larger ones) comes from the main pool instead, and is counted
  (``overflow_bytes``);
* without one (the first step), they come from the main pool.

Every allocation is also placed in an unbounded *shadow* sub-pool with the scratch sub-pool's
placement: its reserved peak (``footprint``) is the size a scratch block needs to hold the same
sequence of allocations and frees. The most bytes live at once (``peak_live``) can be less: a
free leaves a hole a larger temporary does not fit in.
"""

from __future__ import annotations

from collections.abc import Callable

from ..devices.device import MetaDevice
from .pool import DeviceOutOfMemory, Pool

__all__ = ["TEMP_ALIGNMENT", "TemporaryRouter"]

#: Allocation unit of the device library's temporaries (CuPy rounds to 512 bytes).
TEMP_ALIGNMENT = 512
#: Capacity of the shadow sub-pool (never reached: it only measures).
_UNBOUNDED = 1 << 50


class TemporaryRouter:
    """``allocate(nbytes) -> (arena offset, release)`` for one run's temporaries (see the
    module docstring); ``pool`` is the run's pool, ``scratch`` the reserved block or ``None``."""

    def __init__(self, pool: Pool, scratch: tuple[int, int] | None) -> None:
        self.pool = pool
        self.scratch = scratch
        self._sub = None if scratch is None else Pool(MetaDevice(scratch[1]),
                                                      alignment=TEMP_ALIGNMENT)
        self._shadow = Pool(MetaDevice(_UNBOUNDED), alignment=TEMP_ALIGNMENT)
        #: Bytes of temporaries live now, and the most at once.
        self.live = 0
        self.peak_live = 0
        #: Bytes of temporaries that did not fit the scratch block (taken from the pool).
        self.overflow_bytes = 0

    @property
    def footprint(self) -> int:
        """Bytes a scratch block needs for this run's temporaries (the shadow's reserved peak)."""
        return int(self._shadow.stats()["reserved_bytes.peak"])

    def allocate(self, nbytes: int) -> tuple[int, Callable[[], None]]:
        nbytes = max(int(nbytes), 1)
        shadow = self._shadow.allocate(nbytes, tag="cupy.temp", category="workspace")
        base, pool = 0, self.pool
        blk = None
        if self._sub is not None:
            try:
                blk = self._sub.allocate(nbytes, tag="cupy.temp", category="workspace")
                base, pool = self.scratch[0], self._sub
            except DeviceOutOfMemory:
                blk = None
        if blk is None:
            try:
                blk = self.pool.allocate(nbytes, tag="cupy.temp", category="workspace")
            except BaseException:
                self._shadow.free(shadow)
                raise
            if self._sub is not None:
                self.overflow_bytes += blk.size
        self.live += blk.size
        self.peak_live = max(self.peak_live, self.live)

        def release() -> None:  # (CuPy may free from a finalizer inside another pool call)
            self.live -= blk.size
            pool.free_deferred(blk)
            self._shadow.free_deferred(shadow)

        return base + blk.offset, release
