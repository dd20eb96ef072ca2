"""The program as memory sees it: plain data, no layers, no arrays.

The engine lowers a bound network into a :class:`Program`: every tensor of one training
iteration (feature maps, gradient maps, stashes, workspaces, and the persistent parameters,
gradients and optimizer state) with its size and category, and an ordered list of steps, each
naming the tensors it reads and writes, its op tag and its cost. Memory policies turn a
program into a :class:`~minidl.memory.plan.Plan` without knowing anything else about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .units import ALLOCATION_UNIT, aligned


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the program.

    ``role`` says what it is for the engine: ``value`` (an input or a layer output), ``grad``
    (the gradient of a value), ``grad_partial`` (a fan-out partial gradient, added into the
    ``grad`` of ``of`` right after it is written), ``stash`` (saved by forward for backward),
    ``workspace`` (scratch of one step), ``param``, ``param_grad``, ``opt_state``, ``seed``
    (the loss gradient 1.0). ``persistent`` tensors live across iterations.
    """

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    category: str
    role: str
    layer: str = ""
    of: int = -1  # for grad / grad_partial: the value (or grad) tensor it belongs to
    persistent: bool = False

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class StepSpec:
    """One step: a layer's forward or backward, an accumulation, or an optimizer update."""

    index: int
    phase: str  # "forward" | "backward" | "update"
    layer: str
    kind: str  # op tag: conv, relu, pool, ... ; "accumulate" ; "optimizer"
    node: int  # index of the layer node in the network (-1 for none)
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    workspace: int = -1  # tensor id of this step's workspace, or -1
    flops: int = 0
    #: (written, read) tensor pairs the op allows to share one block: an in-place forward
    #: (output over input) or an in-place backward (input gradient over output gradient).
    shares: tuple[tuple[int, int], ...] = ()
    #: Plain facts a pass needs about the op (a max-pool's window, stride and padding; an
    #: encode step's codec) — never arrays or objects.
    attrs: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.layer} ({self.phase})"


@dataclass
class Program:
    """All tensors and steps of one training (or inference) iteration."""

    tensors: list[TensorSpec]
    steps: list[StepSpec]
    inputs: list[int]  # fed tensors (data, labels)
    loss: int = -1  # the loss value tensor, -1 for inference programs
    training: bool = True
    meta: dict = field(default_factory=dict)
    #: For programs rewritten by a pass (recomputation): per step, the index of the lowered
    #: program's step it runs, and the tensor substitutions (original id -> new id) it runs with.
    origins: list[int] | None = None
    remaps: list[dict[int, int]] | None = None
    #: The allocation unit of the pool the program is planned for: every size a pass rounds
    #: (block intervals, peaks, bounds) is rounded to it (see :meth:`block_size`).
    alignment: int = ALLOCATION_UNIT

    def block_size(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` occupies in this program's pool."""
        return aligned(nbytes, self.alignment)

    def tensor(self, tid: int) -> TensorSpec:
        return self.tensors[tid]

    @property
    def persistent(self) -> list[TensorSpec]:
        return [t for t in self.tensors if t.persistent]

    def persistent_bytes(self) -> int:
        return sum(self.block_size(t.nbytes) for t in self.persistent)

    def step_footprint(self, step: StepSpec) -> int:
        """Aligned bytes of the non-persistent tensors one step touches, workspace included;
        an output the op may write over an operand (``shares``) is counted once."""
        ids = set(step.reads) | set(step.writes)
        if step.workspace >= 0:
            ids.add(step.workspace)
        ids -= {w for w, r in step.shares if r in ids
                and self.tensors[w].nbytes == self.tensors[r].nbytes}
        return sum(self.block_size(self.tensors[i].nbytes) for i in ids
                   if not self.tensors[i].persistent)

    def lower_bound_bytes(self) -> int:
        """Persistent state plus the largest single step's own inputs, outputs and workspace:
        no strategy can go below this without splitting the batch."""
        biggest = max((self.step_footprint(s) for s in self.steps), default=0)
        return self.persistent_bytes() + biggest
