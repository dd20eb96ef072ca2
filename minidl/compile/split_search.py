"""Batch splitting (moDNN's): how many micro-batches one training batch runs as.

``split=K`` in the spec says it; with ``auto``, :func:`split_for` searches the fewest
micro-batches (1, 2, 4, ...) whose plan fits the budget and, with a target, more while its
cost model predicts a faster iteration (:func:`faster_split`).
"""

from __future__ import annotations

from typing import Protocol

from ..memory.cost.cost_model import step_costs
from ..memory.cost.targets import DeviceProfile
from ..memory.ir.config import MemoryConfig
from ..memory.planners.auto import BudgetTooSmall
from ..net.graph import Network
from .compiled import Compiled
from .shard_layout import ShardLayout

#: Why a network with batch statistics is never split into micro-batches.
BATCH_STATS_SPLIT = ("batch splitting with BatchNorm would normalise with micro-batch statistics, "
                     "not the batch's: use a larger budget or device memory, or a smaller batch")


def micro_shapes(batch_shapes: list[tuple[int, ...]], label_shape: tuple[int, ...] | None,
                 micro: int) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
    """The same shapes with the batch dimension set to ``micro``."""
    shapes = [(micro, *s[1:]) for s in batch_shapes]
    return shapes, None if label_shape is None else (micro, *label_shape[1:])


class SplittingEngine(Protocol):
    """What the split search needs of an :class:`~minidl.compile.engine.Engine`."""

    net: Network
    config: MemoryConfig
    target: DeviceProfile | None
    #: What this rank keeps of the gradients (:mod:`~minidl.compile.shard_layout`).
    shards: ShardLayout

    def compiled(self, batch_shapes: list[tuple[int, ...]],
                 label_shape: tuple[int, ...] | None, training: bool,
                 label_dtype: str = "int64", accumulate: bool = False) -> Compiled: ...


def split_for(engine: SplittingEngine, batch_shapes: list[tuple[int, ...]],
              label_shape: tuple[int, ...] | None, label_dtype: str = "int64",
              max_split: int = 64) -> int:
    """Micro-batches per batch for ``engine``: see :meth:`Engine.split_for
    <minidl.compile.engine.Engine.split_for>`."""
    k = engine.config.split
    batch_stats = bool(engine.net.buffers())
    if k is not None and k > 1 and batch_stats:
        raise ValueError(BATCH_STATS_SPLIT)
    if k is not None and k > 1 and engine.shards.gradient_specs is not None:
        raise ValueError(f"split={k} accumulates every parameter's full gradient over the "
                         f"micro-batches, which zero={engine.config.zero} does not keep: use "
                         "zero=1 with split, or zero=2 without")
    if k is not None or not engine.config.has("auto"):
        return k or 1
    batch = batch_shapes[0][0]
    if batch_stats or engine.shards.gradient_specs is not None:
        why = BATCH_STATS_SPLIT if batch_stats else (
            f"zero={engine.config.zero} keeps no full gradients to accumulate micro-batches in")
        try:
            engine.compiled(batch_shapes, label_shape, True, label_dtype)
        except BudgetTooSmall as e:  # (the same kind of refusal, with why no split)
            e.args = (f"{e}; batch splitting was not tried: {why}",)
            raise e from None
        return 1
    k, last = 1, None
    while k <= min(max_split, batch):
        try:
            c = engine.compiled(*micro_shapes(batch_shapes, label_shape, -(-batch // k)),
                                True, label_dtype, accumulate=k > 1)
        except BudgetTooSmall as e:
            last = e
            k *= 2
            continue
        return faster_split(engine, k, c, batch_shapes, label_shape, label_dtype,
                            min(max_split, batch))
    raise last


def faster_split(engine: SplittingEngine, k: int, c: Compiled,
                 batch_shapes: list[tuple[int, ...]], label_shape: tuple[int, ...] | None,
                 label_dtype: str, most: int) -> int:
    """With a target, more micro-batches while the cost model predicts a shorter iteration
    (``k`` micro-batches whose plan swaps or recomputes can be slower than ``2k`` whose
    plans need neither); without one, ``k``."""
    target = engine.target
    if target is None:
        return k

    def iteration_s(c: Compiled, k: int) -> float:
        extra = c.plan.provenance.auto.extra_time_s if c.plan.provenance.auto is not None else 0.0
        return k * (sum(step_costs(c.lowered.program, target)) + extra)

    best = iteration_s(c, k)
    while best > 0 and c.plan.provenance.auto is not None \
            and c.plan.provenance.auto.extra_time_s > 0 and 2 * k <= most:
        try:
            c2 = engine.compiled(*micro_shapes(batch_shapes, label_shape,
                                               -(-batch_shapes[0][0] // (2 * k))),
                                 True, label_dtype, accumulate=True)
        except BudgetTooSmall:
            break
        t2 = iteration_s(c2, 2 * k)
        if t2 >= best:
            break
        k, c, best = 2 * k, c2, t2
    return k

