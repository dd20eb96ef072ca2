"""The parts a :class:`~.program.Step` is made of, each a small frozen record by meaning.

- :class:`StepAccess`: what memory sees of a step (the tensors it reads and writes, its
  workspace, the blocks its op may share);
- :class:`ForwardSlots` / :class:`BackwardSlots`: the same tensors as the layer receives them,
  by slot (llm.c's named buffers);
- :class:`StepCost`: what the cost model prices the step by;
- :class:`OpTraits`: what the layer declares about its op and what the plan chose for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .capabilities import OpCaps
from .payloads import CodecStep, EncodedInput, OpFacts, OpOptions


@dataclass(frozen=True)
class GradInput:
    """Where a backward step writes one input's gradient: ``written``, then added into
    ``add_into`` when that gradient already has a writer (fan-out; -1 otherwise)."""

    written: int
    add_into: int = -1


@dataclass(frozen=True)
class StepAccess:
    """What memory sees of a step: the tensors it ``reads`` and ``writes``, its ``workspace``
    (a tensor id, or -1) and ``shares``, the (written, read) pairs the op allows to share one
    block (an in-place forward: output over input; an in-place backward: input gradient over
    output gradient)."""

    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    workspace: int = -1
    shares: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ForwardSlots:
    """The layer's forward slots (tensor ids): inputs and outputs in the layer's order, the
    stash by name, the parameters by the layer's local names; the inputs' shapes; and under
    mixed precision the parameters the step rounds to a half dtype before it computes
    (``param_casts``: local name -> dtype; autocast's weight casts, made by every step that
    reads the weight, in its workspace)."""

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    stash: dict[str, int] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    in_shapes: tuple[tuple[int, ...], ...] = ()
    param_casts: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BackwardSlots:
    """The layer's backward slots (tensor ids): the output gradients it reads, where each
    input's gradient goes, the parameters' ``.grad`` tensors by local name, the partials of
    shared parameters the executor adds, the parameters whose gradient the layer adds straight
    into ``.grad`` (``ctx.accumulate``), and the positions in the forward slots' inputs /
    outputs it reads (its layer's ``retain_inputs`` / ``retain_outputs``)."""

    grad_outputs: tuple[int, ...] = ()
    grad_inputs: tuple[GradInput | None, ...] = ()
    grad_params: dict[str, int] = field(default_factory=dict)
    param_partials: dict[str, int] = field(default_factory=dict)
    accumulate: frozenset[str] = frozenset()
    retained_inputs: tuple[int, ...] = ()
    retained_outputs: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepCost:
    """What the cost model prices a step by: its ``flops``; of them, ``recompute_flops``, the
    forward FLOPs a backward step runs again inside the op (a fused RNN's BPTT schedule keeping
    fewer states); ``matmul_dtype``, what its matrix products run in on tensor cores
    (``"bfloat16"``, ``"float16"``, ``"tf32"``; ``""``: float32 on CUDA cores, set by lowering
    from the precision, :mod:`.precision`); and ``origin``, the lowered step it runs, by which
    measured step times are keyed (itself for lowered steps; a recomputation's forward step;
    -1 for steps a pass added)."""

    flops: int = 0
    recompute_flops: int = 0
    matmul_dtype: str = ""
    origin: int = -1


@dataclass(frozen=True)
class OpTraits:
    """What the layer declares about its op and what the plan chose for it.

    ``facts``: plain facts a pass needs (a max-pool's window, attention's shape, a fused RNN's
    time units); ``caps``: what memory passes may do with the op; ``options``: per-op options
    the plan set (a BPTT schedule, ...), handed to the layer at run time (a plain
    ``{name: value}`` mapping is accepted and made an :class:`OpOptions`); ``forced``: the
    user's choice for the feature maps the op's forward writes, from a block the network marks
    (``"recompute"``, ``"swap"`` or ``"keep"``; ``""``: the planner's to make, honoured by every
    planner, :mod:`.block_choices`); ``codec``: an encode / decode step's codec and the tensor
    it encodes or decodes; ``from_encoded``: a backward step starting from an encoded stash,
    which encoding in which tensor.
    """

    facts: OpFacts = OpFacts()
    caps: OpCaps = OpCaps()
    options: OpOptions = OpOptions()
    forced: str = ""
    codec: CodecStep | None = None
    from_encoded: EncodedInput | None = None

    def __post_init__(self) -> None:
        if type(self.options) is not OpOptions:
            object.__setattr__(self, "options", OpOptions.of(self.options))
        if type(self.facts) is not OpFacts:
            object.__setattr__(self, "facts", OpFacts.of(self.facts))
