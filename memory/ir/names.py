"""The closed vocabularies of programs: a step's phase, a tensor's role and its category.

Each is an :class:`enum.Enum` whose members are also the plain strings they stand for
(``Phase.FORWARD == "forward"``, same hash, ``f"{Phase.FORWARD}"`` is ``"forward"``), so
programs, plans, reports and JSON read as before while an unknown name fails where it is made,
naming the valid ones.
"""

from __future__ import annotations

from enum import Enum


class Name(str, Enum):
    """A member of a closed set of names that behaves as its string everywhere."""

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
            raise ValueError(f"unknown {cls.__name__.lower()} {value!r}; valid: {valid}") \
                from None


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
