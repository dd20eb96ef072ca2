"""A :func:`~minidl.analysis.meta_run.dry_run`'s options, by what they set: what the iteration
is fed (:class:`DryRunInputs`), the device it is planned for (:class:`DryRunDevice`) and what
the run writes and reports (:class:`DryRunOutputs`). ``dry_run(net, 32, "auto", target="a100")``
takes each field as a keyword too (:meth:`DryRunOptions.with_keywords`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..layers.base import Layer
from ..memory.cost.targets import DeviceProfile
from ..memory.ir.precision import Precision
from ..memory.ir.units import ALLOCATION_UNIT
from ..net.option_groups import field_names, with_keywords


@dataclass(frozen=True)
class DryRunInputs:
    """The iteration run: the loss (default softmax cross-entropy), the labels' and the input's
    shape per sample (defaults: the network's), and training (forward and backward) or
    inference."""

    loss: Layer | None = None
    label_shape: tuple[int, ...] | None = None
    input_shape: tuple[int, ...] | None = None
    training: bool = True


@dataclass(frozen=True)
class DryRunDevice:
    """The device planned for: its kind, the pool's allocation unit, the scratch block a GPU
    run reserves, a target GPU (:mod:`~minidl.memory.cost.targets`; ``emulated``: a CPU run
    emulating its link), the data-parallel ranks and the precision."""

    device_kind: str = "cpu"
    alignment: int = ALLOCATION_UNIT
    scratch_bytes: int | None = None
    target: str | DeviceProfile | None = None
    emulated: bool = False
    ranks: int = 1
    precision: Precision | str = Precision.FP32


@dataclass(frozen=True)
class DryRunOutputs:
    """What the report lists and the files written: the largest tensors live at the peak, the
    timeline plot, the trace, the memory snapshot, and the budget drawn on the plot."""

    top: int = 10
    plot: str | None = None
    trace: str | None = None
    snapshot: str | os.PathLike | None = None
    budget: int | None = None


class DryRunKeywords(TypedDict, total=False):
    """The keyword arguments :func:`~minidl.analysis.meta_run.dry_run` takes beside its
    options (each a field of one group)."""

    loss: Layer | None
    label_shape: tuple[int, ...] | None
    input_shape: tuple[int, ...] | None
    training: bool
    device_kind: str
    alignment: int
    scratch_bytes: int | None
    target: str | DeviceProfile | None
    emulated: bool
    ranks: int
    precision: Precision | str
    top: int
    plot: str | None
    trace: str | None
    snapshot: str | os.PathLike | None
    budget: int | None


@dataclass(frozen=True)
class DryRunOptions:
    """Every option of a dry run, grouped (each group's defaults are ``dry_run``'s)."""

    inputs: DryRunInputs = field(default_factory=DryRunInputs)
    device: DryRunDevice = field(default_factory=DryRunDevice)
    outputs: DryRunOutputs = field(default_factory=DryRunOutputs)

    def with_keywords(self, keywords: dict[str, Any]) -> DryRunOptions:
        """These options with each keyword (a field of one group) set; an unknown one raises
        ``TypeError`` naming the valid ones."""
        options, left = with_keywords(self, keywords)
        if left:
            raise TypeError(f"dry_run() got an unexpected keyword argument "
                            f"{next(iter(left))!r} (valid: {', '.join(keyword_names())})")
        return options


def keyword_names() -> list[str]:
    """Every keyword :meth:`DryRunOptions.with_keywords` takes, sorted."""
    return field_names(DryRunOptions())
