"""What one rank keeps of the persistent state (parameters, gradients) when it is sharded across
ranks, as the engine asks it. The layout is the optimizer's to supply (``optimizer.shard_layout
(training)``: :class:`minidl.distributed.zero.ZeroOptimizer` gives ZeRO's); the engine names no
strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .lowering import Sharding

#: ``alloc(name, shape, dtype, category)``: a persistent block of the engine's pool, as an array.
Allocate = Callable[[str, tuple[int, ...], Any, str], Any]

Specs = list[tuple[str, tuple[int, ...], str]]


class ShardLayout:
    """Every parameter and gradient whole on this rank (no sharding). A layout that shards
    has the same four members (duck-typed: its package need not import this one)."""

    #: The gradient shards' and parameter shards' (name, shape, dtype) as allocated, or
    #: ``None`` where that state is kept whole.
    gradient_specs: Specs | None = None
    parameter_specs: Specs | None = None

    def keeps_whole(self, param: Any) -> bool:
        """Whether the engine allocates ``param``'s whole block (else its shard stands in)."""
        return True

    def allocate_shards(self, alloc: Allocate, compute: bool) -> None:
        """Allocate the shards through ``alloc`` before the optimizer's state (``compute``: the
        device holds data: fill them)."""

    @classmethod
    def offloaded(cls) -> ShardLayout:
        """Parameters whole; no gradient on the device between iterations (``offload``: they
        are tensors of the iteration, copied to the host as backward writes them)."""
        layout = cls()
        layout.gradient_specs = []
        return layout

    @classmethod
    def streamed(cls) -> ShardLayout:
        """No trainable parameter and no gradient on the device between iterations
        (``offload=parameters``: every step's parameters are tensors of the iteration,
        streamed in from the host)."""
        return _Streamed()


class _Streamed(ShardLayout):
    gradient_specs: Specs | None = []
    parameter_specs: Specs | None = []

    def keeps_whole(self, param: Any) -> bool:
        return not param.trainable


class UnallocatedShards(ShardLayout):
    """Sharding stage ``stage`` (2: gradients, 3: also parameters when ``training``) with an
    optimizer that does not shard: a dry run's, whose rank's shards are accounted by
    :mod:`minidl.memory.passes.zero`; nothing is allocated for them and training refuses it."""

    def __init__(self, stage: int, training: bool, optimizer_name: str = "optimizer") -> None:
        self.stage = stage
        self.optimizer_name = optimizer_name
        self.gradient_specs = []
        self.parameter_specs = [] if stage >= 3 and training else None

    def keeps_whole(self, param: Any) -> bool:
        return self.parameter_specs is None or not param.trainable

    def allocate_shards(self, alloc: Allocate, compute: bool) -> None:
        if compute:
            raise ValueError(f"zero={self.stage} trains with the optimizer wrapped in "
                             "minidl.distributed.zero.ZeroOptimizer (as Trainer does), not a "
                             f"bare {self.optimizer_name}")


def shard_layout(stage: int, optimizer: Any, training: bool) -> ShardLayout:
    """The layout of sharding stage ``stage`` (whole below 2): the optimizer's own when it
    supplies one, else :class:`UnallocatedShards`."""
    if stage < 2:
        return ShardLayout()
    supply = getattr(optimizer, "shard_layout", None)
    if supply is not None:
        return supply(training)
    return UnallocatedShards(stage, training, type(optimizer).__name__)


def sharding_of(layout: Any) -> Sharding | None:
    """What lowering needs of ``layout``: its shards as a :class:`Sharding` (``None``: whole)."""
    if layout.gradient_specs is None:
        return None
    params = None if layout.parameter_specs is None else tuple(layout.parameter_specs)
    return Sharding(tuple(layout.gradient_specs), params)
