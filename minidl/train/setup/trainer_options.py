"""A :class:`~minidl.train.trainer.Trainer`'s options, by what they set: the device
(:class:`DeviceOptions`), the training step (:class:`StepOptions`) and data parallelism
(:class:`ParallelOptions`). ``Trainer(net, opt, memory, device="cpu", seed=1, ...)`` takes
each field as a keyword too (:meth:`TrainerOptions.with_keywords`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from ...distributed.comm import Communicator
from ...distributed.data_parallel import DEFAULT_BUCKET_BYTES
from ...layers.base import Layer
from ...memory.cost.targets import DeviceProfile
from ...memory.ir.precision import Precision
from ...memory.ir.units import ALLOCATION_UNIT
from ...net.option_groups import with_keywords


@dataclass(frozen=True)
class DeviceOptions:
    """What the trainer runs on (:func:`~minidl.train.setup.device_setup.set_up_device`)."""

    device: Any = "cpu"
    device_memory: int | str = "auto"
    host_memory: int | str | None = None
    debug: bool | None = None
    threads: int | None = None
    alignment: int = ALLOCATION_UNIT
    emulate_link: str | DeviceProfile | None = None


@dataclass(frozen=True)
class StepOptions:
    """How each training step runs: the loss (default softmax cross-entropy), the seed of its
    random masks, gradient clipping, the scheduler, gradient accumulation and the precision
    (:mod:`~minidl.memory.ir.precision`: ``fp32``, ``bf16-mixed``, ``fp16-mixed``)."""

    loss: Layer | None = None
    seed: int = 0
    clip_grad_norm: float | None = None
    scheduler: Any = None
    accumulate_grad_batches: int = 1
    precision: Precision | str = Precision.FP32


@dataclass(frozen=True)
class ParallelOptions:
    """Data parallelism (:mod:`minidl.distributed.data_parallel`): the ranks, the gradient
    buckets' size and synchronised BatchNorm."""

    comm: Communicator | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    sync_bn: bool = False


class TrainerKeywords(TypedDict, total=False):
    """The keyword arguments :class:`~minidl.train.trainer.Trainer` takes beside its options."""

    device: Any
    device_memory: int | str
    host_memory: int | str | None
    debug: bool | None
    threads: int | None
    alignment: int
    emulate_link: str | DeviceProfile | None
    loss: Layer | None
    seed: int
    clip_grad_norm: float | None
    scheduler: Any
    accumulate_grad_batches: int
    precision: Precision | str
    comm: Communicator | None
    bucket_bytes: int
    sync_bn: bool


@dataclass(frozen=True)
class TrainerOptions:
    """Every option of a trainer, grouped (each group's defaults are the trainer's)."""

    device: DeviceOptions = field(default_factory=DeviceOptions)
    step: StepOptions = field(default_factory=StepOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)

    def with_keywords(self, keywords: dict[str, Any]) -> TrainerOptions:
        """These options with each keyword (a field of one group) set; an unknown one raises
        ``TypeError`` as Python does for a function's."""
        options, left = with_keywords(self, keywords)
        if left:
            raise TypeError(f"Trainer() got an unexpected keyword argument {next(iter(left))!r}")
        return options
