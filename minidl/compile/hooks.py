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


class _FormerHooks:
    """An object with the hooks' former names (``grad_ready``, ``gather_params``) as
    :class:`StepHooks`."""

    def __init__(self, obj: Any) -> None:
        self.batch_sync = getattr(obj, "batch_sync", None)
        self.before_step = getattr(obj, "gather_params", None)
        self.after_backward_step = obj.grad_ready


def step_hooks(obj: Any) -> StepHooks | None:
    """``obj`` as :class:`StepHooks` (``None`` stays ``None``); an object still offering the
    former names ``grad_ready`` / ``gather_params`` is read through them."""
    if obj is None or hasattr(obj, "after_backward_step"):
        return obj
    return _FormerHooks(obj)
