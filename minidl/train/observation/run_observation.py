"""What a :class:`~minidl.train.trainer.Trainer` observes of its runs (``trainer.observed``):
where the training iterations and evaluations peaked, the step times, the last iteration that
swapped, batches run in parts, and the memory recording in progress."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ...analysis.memory_record import MemoryRecorder
from ...compile.engine import Compiled, Engine, PeakInfo


class RunObservation:
    """Peaks, times and swapping of the runs of one trainer's ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        #: Where the highest training iteration peaked (:class:`PeakInfo`), or ``None``.
        self.peak: PeakInfo | None = None
        #: Each training step's wall time in seconds.
        self.step_times: list[float] = []
        #: The micro-batches the last training batch ran as (``split``).
        self.last_split = 1
        #: Evaluation batches that did not fit the device memory and ran in halves.
        self.eval_splits = 0
        #: The highest peak (bytes in use, persistent state included) of an evaluation batch
        #: and that batch's size: evaluations at larger batches than training's can set the
        #: pool's peak (said in the memory report).
        self.eval_peak: tuple[int, int] | None = None
        #: Iterations that fell back from the tensor cache to plain swapping.
        self.cache_fallbacks = 0
        #: The memory recording in progress (:meth:`recording_memory`), or ``None``.
        self.recorder: MemoryRecorder | None = None
        self._swap_runtime: Any = None  # the runtime of the last iteration that swapped

    def after_iteration(self, c: Compiled, iteration: int) -> None:
        """A training iteration of ``c`` ran: its peak, itemised only when it is a new peak or
        a recording wants it, and its swapping."""
        rt = c.executor.last_runtime
        if self.peak is None or rt.peak.bytes > self.peak.bytes or self.recorder is not None:
            self.note_peak(c, iteration)
        if c.plan.swapping.blocks or self.engine.host_state is not None:
            self._swap_runtime = rt

    def note_peak(self, c: Compiled, iteration: int) -> None:
        """Where the last run of ``c`` peaked: the peak when higher, and the recording's."""
        info = self.engine.peak_info(c)
        if self.peak is None or info.bytes > self.peak.bytes:
            self.peak = info
        if self.recorder is not None:
            self.recorder.capture(c, info, iteration, timed=self.engine.compute)

    def note_evaluation(self, peak: int, batch_size: int) -> None:
        """An evaluation batch of ``batch_size`` peaked at ``peak`` bytes."""
        if self.eval_peak is None or peak > self.eval_peak[0]:
            self.eval_peak = (peak, batch_size)

    def swap_stats(self, optimizer: Any = None) -> dict[str, Any]:
        """What swapping did in the last iteration that swapped or offloaded; empty when
        nothing was. ``optimizer``: the trainer's; offloaded (``offload=optimizer``), the
        bytes its update copies back to the device and the seconds of its last step's host
        update and copy back."""
        rt = self._swap_runtime
        if rt is None:
            return {}
        stats = rt.swap_stats.as_dict()
        stats["host_peak_bytes"] = self.engine.host_pool.peak_bytes
        host = self.engine.host_state
        if host is not None:
            stats["uploaded_parameter_bytes"] = host.upload_bytes
            stats["host_update_s"] = getattr(optimizer, "last_update_s", None)
            stats["parameter_upload_s"] = getattr(optimizer, "last_upload_s", None)
        return stats

    @contextmanager
    def recording_memory(self, recorder: MemoryRecorder) -> Iterator[MemoryRecorder]:
        """``recorder`` captures the training iterations run inside the block."""
        outer, self.recorder = self.recorder, recorder
        try:
            yield recorder
        finally:
            self.recorder = outer
