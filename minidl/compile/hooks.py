"""What the executor calls around a run's steps, declared: data parallelism (gradient buckets,
ZeRO's per-step parameter gathers, synchronised BatchNorm) implements it, and the executor
knows only this protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class StepHooks(Protocol):
    """Hooks of one run (``Executor.run(hooks=)``)."""

    #: :attr:`Context.batch_sync <minidl.layers.base.Context.batch_sync>` for the layers
    #: (statistics over more than this process's batch), or ``None``.
    batch_sync: Any

    #: ``before_step(executor, i)`` before step ``i`` computes (for instance parameters
    #: gathered into their blocks), or ``None`` when there is nothing to do.
    before_step: Callable[[Any, int], None] | None

    def after_backward_step(self, executor: Any, index: int) -> None:
        """After backward step ``index`` (for instance the gradient buckets it completed
        sent on)."""
