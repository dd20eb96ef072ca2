"""The words kernels, layers and memory share, as enums whose members are also their strings.

``kernels`` is the one package both ``layers`` and ``memory`` import, so the vocabularies a
layer speaks (the device kind it is handed, the capabilities it declares) live here, below
both; memory's own vocabularies (:mod:`minidl.memory.ir.names`) build on :class:`Name`.
"""

from __future__ import annotations

import re
from enum import Enum


class Name(str, Enum):
    """A member of a closed set of names that behaves as its string everywhere
    (``DeviceKind.CPU == "cpu"``, same hash, ``f"{DeviceKind.CPU}"`` is ``"cpu"``)."""

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def of(cls, value: str) -> Name:
        """``value`` as a member; a ``ValueError`` naming the valid values otherwise."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            what = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # "device kind"
            raise ValueError(f"unknown {what} {value!r}; valid: {valid}") from None


class DeviceKind(Name):
    """The kind of device a program is lowered for (workspaces and kernels differ per kind)."""

    CPU = "cpu"
    CUDA = "cuda"


class RecomputeCost(Name):
    """How recomputation policies treat an op's outputs (a layer's ``recompute_cost``)."""

    #: Cheap to recompute (activations, normalisation, pooling, dropout, reshapes): dropped.
    CHEAP = "cheap"
    #: Expensive (convolution, linear, embedding) or a join (add, concat): kept as checkpoints
    #: by the speed / memory / cost policies.
    EXPENSIVE = "expensive"
    #: A whole sequence in one op (fused RNNs): never recomputed as a whole (it recomputes
    #: over time inside, by its own BPTT schedule); its outputs are always checkpoints.
    SEQUENCE = "sequence"


class StashEncoding(Name):
    """Encodings an op's backward can start from, instead of its dense stash (Gist; a layer's
    ``backward_from``)."""

    #: Only the sign of output 0 (ReLU): a 1-bit mask.
    SIGN = "sign"
    #: Its ``argmax`` stash packed to the fewest bits its window needs (max-pool).
    PACKED_ARGMAX = "packed_argmax"
