"""Training precision: the value users choose (``fp32``, ``tf32``, ``bf16-mixed``,
``fp16-mixed``) and the op policy that gives every tensor of a program its dtype.

The policy is ``torch.autocast``'s (CUDA op lists, PyTorch 2.x): matrix ops (convolution,
linear, scaled-dot-product attention, RNN cells) compute in the half dtype with float32
accumulation; losses, softmax and layer / group normalisation in float32 (its float32 list);
every other op in its inputs' dtype, float32 where they mix (type promotion). Batch
normalisation is on neither list: it runs in its input's dtype, its statistics in float32
(so is attention's row log-sum-exp); a recurrence keeps its gates and states in half, rounded
step by step.
Parameters stay float32 (the master copy); a matrix op uses a half copy of each weight,
made at its forward and kept for its backward (autocast's weight-cast cache). Where an op
computes in half on a float32 input, it works on a cast copy: the copy its backward reads is
kept with its stash, others live for the step only (its workspace). The float32 ops read half
inputs without a copy (minidl's loss and normalisations convert chunk by chunk inside the
kernel, as fused cross-entropy and layer-norm kernels do) and write their input gradients in
the input's dtype. Gradients take their value's dtype; parameter gradients and the optimizer
update stay float32.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from ...kernels.vocabulary import Name

try:  # registers numpy's "bfloat16" dtype (the NumPy dtype package of JAX and CuPy)
    import ml_dtypes  # noqa: F401
except ImportError:  # pragma: no cover (bf16 programs then need it: numpy has no bfloat16)
    pass

__all__ = ["FLOAT32_OPS", "MATRIX_OPS", "Precision", "bytes_by_dtype", "is_float", "itemsize",
           "op_dtype", "promoted"]


class Precision(Name):
    """What a training iteration computes and stores in."""

    FP32 = "fp32"  # float32 everywhere, matrix products on CUDA cores (the default)
    TF32 = "tf32"  # float32 tensors, matrix products on TF32 tensor cores (Ampere on)
    BF16_MIXED = "bf16-mixed"  # autocast to bfloat16, float32 master weights
    FP16_MIXED = "fp16-mixed"  # autocast to float16 (with loss scaling), float32 master weights

    @property
    def half_dtype(self) -> str | None:
        """The dtype matrix ops compute and store in under mixed precision (else None)."""
        return {Precision.BF16_MIXED: "bfloat16", Precision.FP16_MIXED: "float16"}.get(self)

    @property
    def matmul_dtype(self) -> str:
        """What matrix products run in: ``"bfloat16"``, ``"float16"``, ``"tf32"``, or
        ``""`` for float32 on CUDA cores."""
        return self.half_dtype or ("tf32" if self is Precision.TF32 else "")


#: autocast's lower-precision list, by layer kind: convolutions, linear (matmul / addmm),
#: attention (scaled_dot_product_attention, bmm), RNN cells (lstm_cell, gru_cell).
MATRIX_OPS = frozenset({"conv", "linear", "attention", "rnn", "recurrent"})
#: autocast's float32 list, by layer kind: losses (cross_entropy / nll_loss, mse_loss) and
#: layer normalisation.
FLOAT32_OPS = frozenset({"loss", "norm"})
#: Ops that run in their input's dtype and keep their statistics in float32 (batch norm).
FLOAT32_STATISTICS_OPS = frozenset({"bn"})

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``"bfloat16"`` without ml_dtypes too)."""
    return _ITEMSIZE.get(str(dtype)) or np.dtype(dtype).itemsize


def is_float(dtype) -> bool:
    """Whether ``dtype`` is a floating type (bfloat16 too: NumPy does not class ml_dtypes'
    types as ``np.floating``)."""
    dt = np.dtype(dtype)
    return bool(np.issubdtype(dt, np.floating)) or dt.name == "bfloat16"


def promoted(dtypes: Iterable[str]) -> str:
    """The widest floating dtype of ``dtypes`` (type promotion: float16 with bfloat16 gives
    float32, as in PyTorch); ``"float32"`` for none."""
    floats = set(dtypes)
    if not floats:
        return "float32"
    if len(floats) == 1:
        return floats.pop()
    return max(floats, key=itemsize) if any(itemsize(d) > 2 for d in floats) else "float32"


def op_dtype(kind: str, input_dtypes: Sequence[str], precision: Precision) -> str:
    """The dtype an op of layer ``kind`` computes and writes in, given its floating inputs'
    dtypes (the module docstring's policy); float32 ops for ``fp32`` and ``tf32``."""
    half = precision.half_dtype
    if half is None or kind in FLOAT32_OPS:
        return "float32"
    if kind in MATRIX_OPS:
        return half
    return promoted(input_dtypes)


def bytes_by_dtype(tensors: Iterable) -> dict[str, int]:
    """Bytes of ``tensors`` (objects with ``dtype`` and ``nbytes``) by dtype, largest first."""
    out: dict[str, int] = defaultdict(int)
    for t in tensors:
        out[str(t.dtype)] += t.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
