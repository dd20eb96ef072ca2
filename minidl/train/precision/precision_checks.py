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
    train in ``precision``: mixed precision runs on the CPU (or the meta
    device; data parallel, ZeRO and the codecs too), over :data:`MIXED_PRECISION_KINDS`
    layers."""
    if precision.half_dtype is None:
        if precision is Precision.TF32:
            raise ValueError("precision='tf32' is a GPU setting (TF32 tensor cores); the CPU "
                             "trains in fp32, bf16-mixed or fp16-mixed")
        return
    if device_kind is not DeviceKind.CPU:
        raise ValueError(f"precision={precision.value!r} trains on the cpu device for now "
                         f"(not {device_kind}); minidl plan --precision plans it for a GPU")
    other = sorted({type(node.layer).__name__ for node in net.nodes
                    if getattr(node.layer, "kind", None) not in MIXED_PRECISION_KINDS
                    and node.layer is not None and hasattr(node.layer, "kind")})
    if other:
        raise ValueError(f"precision={precision.value!r} supports Conv2d, Linear, pooling, "
                         "activations, BatchNorm, LayerNorm, Flatten, Add, Dropout, "
                         "embeddings, attention, the recurrent layers and the losses; this "
                         f"network has {', '.join(other)}")


def loss_scaler_for(precision: Precision) -> DynamicLossScaler | None:
    """fp16-mixed's dynamic loss scaler (``None`` in the other precisions)."""
    return DynamicLossScaler() if precision is Precision.FP16_MIXED else None
