"""Data parallelism under ``offload=optimizer`` (ZeRO-Offload): the gradients are averaged in
the host's landing buffers, where the host's update reads them.

The plan copies each gradient to the host as backward writes it
(:mod:`minidl.memory.passes.offload_state`), so the device keeps no gradient for
:class:`~.data_parallel.GradientSync` to read when backward completes it. :class:`OffloadSync`
is that sync over the landing buffers (:meth:`HostState.flat_gradients
<minidl.compile.host_state.HostState.flat_gradients>`): the same buckets in the same order,
each launched once every gradient in it has *landed* (the plan's ``Release`` of its copy has
run, which waits for the copy), scaled in place by the rank's share and all-reduced in place on
the communication thread while backward goes on. The parameters lie in network order in the
landing buffers, so a bucket is one contiguous range of them: no bucket buffers, no copy back,
no device memory. The arithmetic is plain data parallelism's (each gradient times the share,
summed over the ranks), so training is bit-identical to it on 2 ranks.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..memory.ir.names import Phase, Role
from ..memory.ir.plan import Release
from .comm import Communicator
from .data_parallel import DEFAULT_BUCKET_BYTES, GradientSync


class OffloadSync(GradientSync):
    """Bucketed gradient averaging of the trainable ``params`` (in network order) in
    ``host_state``'s landing buffers (see the module docstring)."""

    def __init__(self, comm: Communicator, params: Sequence[Any], host_state: Any,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True) -> None:
        super().__init__(comm, params, bucket_bytes, overlap)
        offsets = host_state.offsets
        missing = [p.name for p in self.params if p.name not in offsets]
        starts = [offsets[p.name][0] for p in self.params if p.name in offsets]
        if missing or starts != sorted(starts) or len(offsets) != len(self.params):
            raise ValueError("offload=optimizer with data parallelism: the optimizer must hold "
                             "every trainable parameter of the network, in the network's order")
        self._flat = host_state.flat_gradients()
        size = self._flat.itemsize
        #: (first element, element count, block end) of each parameter in the flat buffer
        self._slots = [(offsets[p.name][0] // size, int(np.prod(p.shape)),
                        sum(offsets[p.name]) // size) for p in self.params]
        # each bucket's range of the landing buffers replaces its bucket buffer
        self._buffers = [self._flat[self._slots[min(m)][0]:self._slots[max(m)][2]]
                         for m in self.buckets]

    def _ready_after(self, executor: Any) -> dict[int, list[tuple[int, int]]]:
        """Backward step index -> parameters (our indices) whose gradient has landed on the
        host when the executor's hook runs after that step (the hook comes before the step's
        own actions: a ``Release`` after step ``r`` is seen at the next backward step), each
        with its gradient's tensor id; gradients released at the plan's end are not listed
        (:meth:`finish` launches their buckets)."""
        plan = executor.plan
        prog = plan.program
        hit = self._ready_cache.get(id(prog))
        if hit is not None and hit[0] is prog:
            return hit[1]
        released = {a.tensor: i for i, sp in enumerate(plan.steps) for a in sp.after
                    if isinstance(a, Release)}
        backward = [i for i, st in enumerate(executor.steps) if st.phase == Phase.BACKWARD]
        index = {p.name: j for j, p in enumerate(self.params)}
        ready: dict[int, list[tuple[int, int]]] = {}
        for t in prog.tensors:
            j = index.get(t.name.removesuffix(".grad"))
            if t.role != Role.PARAM_GRAD or j is None or t.id not in released:
                continue
            k = bisect.bisect_right(backward, released[t.id])
            if k < len(backward):
                ready.setdefault(backward[k], []).append((j, t.id))
        self._ready_cache[id(prog)] = (prog, ready)
        return ready

    def zero_local(self) -> None:
        """This rank has no rows this step: it adds zeros to the sums."""
        self._flat[...] = 0

    def _launch(self, b: int) -> None:
        """Scale bucket ``b``'s gradients by the share in place (the alignment bytes between
        them zeroed: the device's block copied whatever they held) and all-reduce it."""
        self._launched[b] = True
        flat = self._flat
        for i in self.buckets[b]:
            lo, n, end = self._slots[i]
            g = flat[lo:lo + n]
            np.multiply(g, self._share, out=g)
            flat[lo + n:end] = 0
        self._hand_off(b)

    def _reduce(self, b: int) -> None:
        """Sum bucket ``b``'s range of the landing buffers over the ranks, in place."""
        t0 = time.perf_counter()
        self.comm.allreduce(self._buffers[b])
        self._comm_s += time.perf_counter() - t0
