"""What a :class:`~minidl.train.trainer.Trainer` trains in mixed precision today, and the
one-line refusals of the rest."""

from __future__ import annotations

from ...compile.mixed_steps import MIXED_PRECISION_KINDS
from ...memory.ir.names import DeviceKind
from ...memory.ir.precision import Precision
from ...net.graph import Network
from .loss_scaling import DynamicLossScaler

__all__ = ["check_precision", "loss_scaler_for"]


def check_precision(precision: Precision, net: Network, device_kind: DeviceKind) -> None:
    """Raise ``ValueError`` (one line) when ``net`` on a device of ``device_kind`` cannot
    train in ``precision``: mixed precision runs on the CPU and CUDA devices (the strict test
    device and the meta device too; data parallel, ZeRO and the codecs as well), over
    :data:`MIXED_PRECISION_KINDS` layers (on a CUDA device their float32 compute copies are
    staged in their steps' workspaces: :mod:`~minidl.compile.mixed_staging`)."""
    if precision.half_dtype is None:
        if precision is Precision.TF32:
            raise ValueError("precision='tf32' is a GPU setting (TF32 tensor cores) minidl "
                             "plans but does not train in: training runs in fp32, bf16-mixed "
                             "or fp16-mixed")
        return
    if device_kind not in (DeviceKind.CPU, DeviceKind.CUDA):
        raise ValueError(f"precision={precision.value!r} trains on the cpu and cuda devices, "
                         f"not {device_kind}")
    other = sorted({type(node.layer).__name__ for node in net.nodes
                    if getattr(node.layer, "kind", None) not in MIXED_PRECISION_KINDS
                    and node.layer is not None and hasattr(node.layer, "kind")})
    if other:
        raise ValueError(f"precision={precision.value!r} supports Conv2d, Linear, pooling, "
                         "activations, BatchNorm, LayerNorm, Flatten, Add, Concat, Dropout, "
                         "embeddings, attention, the recurrent layers and the losses; this "
                         f"network has {', '.join(other)}")


def loss_scaler_for(precision: Precision) -> DynamicLossScaler | None:
    """fp16-mixed's dynamic loss scaler (``None`` in the other precisions)."""
    return DynamicLossScaler() if precision is Precision.FP16_MIXED else None
