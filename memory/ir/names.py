"""The closed vocabularies of programs: a step's phase, a tensor's role and its category, the
device kind a program is lowered for and the codec of an encode / decode step.

Each is an :class:`enum.Enum` whose members are also the plain strings they stand for
(``Phase.FORWARD == "forward"``, same hash, ``f"{Phase.FORWARD}"`` is ``"forward"``), so
programs, plans, reports and JSON read as before while an unknown name fails where it is made,
naming the valid ones. :class:`Name` and :class:`DeviceKind` live in
:mod:`minidl.kernels.vocabulary`, where layers can read them too.
"""

from __future__ import annotations

from ...kernels.vocabulary import DeviceKind, Name

__all__ = ["Category", "Codec", "DeviceKind", "Name", "Phase", "Role"]


class Phase(Name):
    """When a step runs in the iteration."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # a forward step run again in backward (recomputation)
    ENCODE = "encode"  # a stash compressed after its forward writer (Gist, reduced precision)
    DECODE = "decode"  # an encoded stash expanded before its backward reader


class Role(Name):
    """What a tensor is for the engine."""

    VALUE = "value"  # an input or a layer output
    GRAD = "grad"  # the gradient of a value
    GRAD_PARTIAL = "grad_partial"  # a fan-out partial gradient, added into the grad of ``of``
    STASH = "stash"  # saved by forward for backward
    WORKSPACE = "workspace"  # scratch of one step
    PARAM = "param"
    PARAM_GRAD = "param_grad"
    OPT_STATE = "opt_state"
    SEED = "seed"  # the loss gradient 1.0
    ZEROS = "zeros"  # a gradient that starts at zero (written by accumulation only)
    GRAD_SHARD = "grad_shard"  # ZeRO 2/3: this rank's shard of a parameter's gradient
    PARAM_SHARD = "param_shard"  # ZeRO 3: this rank's shard of a parameter
    ENCODED = "encoded"  # an encode step's compressed copy of a stash


class Category(Name):
    """What a block holds: the pool keeps its statistics per category."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    FEATURE_MAP = "feature_map"
    GRADIENT_MAP = "gradient_map"
    WORKSPACE = "workspace"
    STASH = "stash"
    INPUT = "input"
    ENCODED = "encoded"


class Codec(Name):
    """How an encode step stores a tensor and its decode step restores it."""

    SIGN = "sign"  # ReLU's output as its 1-bit sign (Gist binarize)
    POOLIDX = "poolidx"  # a max-pool's argmax packed to the fewest bits its window needs
    SPARSE = "sparse"  # CSR / zero-value compression (Gist SSDC)
    FP16 = "fp16"  # reduced precision (Gist DPR)
    BF16 = "bf16"
    FP8 = "fp8"
    WEIGHTS = "weights"  # a compressed weight record decoded for inference
