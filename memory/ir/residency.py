"""Where each tensor of an iteration lives: one explicit state per tensor, one transition table.

A :class:`TensorRecord` holds a tensor's :class:`Residency` and what that state owns — the
device block and the view steps read, the host buffer and the copy events of a swap. Its
transitions are methods; each looks itself up in :data:`TRANSITIONS` (the one table of legal
moves) and raises :class:`IllegalTransition` naming the tensor, the state and the action when
the move is not there. :class:`~minidl.memory.runtime.runtime.MemoryRuntime` keeps one record per
tensor and drives them from the plan's actions (each action declares its move,
``Action.residency``), and :meth:`~minidl.memory.ir.plan.Plan.validate` checks a plan against
the same table before it runs::

    unallocated or freed --allocate--> on_device --offload--> offloading --release--> on_host
    offloading --keep_cached--> cached --evict--> on_host --prefetch--> prefetching
    cached --reuse_cached--> prefetching --await_prefetch--> on_device
    on_device --reallocate--> on_device;  any state holding something --free--> freed

Two states of DESIGN's list are not runtime states, because the passes that make them give the
runtime separate tensors:

- *encoded*: compression (:mod:`.compress`) adds an encoded stash as its own tensor; the
  feature map it encodes is ``freed`` after the encode step, the stash goes ``unallocated`` ->
  ``on_device`` -> ``freed`` like any tensor, and decoding writes a third one.
- *dropped*: recomputation (:mod:`.recompute`) frees a dropped feature map after its forward
  use (``freed``); backward reads a clone, a separate tensor allocated by the recompute step.

An alias (a tensor computed in place or sharing its root's block, ``Plan.aliases``) has a record
of its own that owns only its view: ``on_device`` means alive, a view of its root's block,
while the block itself follows the root's record (the view is absent while the root is away).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .names import Name


class Residency(Enum):
    """The state of one tensor within an iteration."""

    UNALLOCATED = "unallocated"  # no action has put it anywhere yet
    ON_DEVICE = "on_device"  # a device block (or, for an alias, a live view); steps may read it
    OFFLOADING = "offloading"  # block still on device, being copied to host; no views
    ON_HOST = "on_host"  # only the host copy exists
    PREFETCHING = "prefetching"  # block on device again, the copy back may still run; no views
    CACHED = "cached"  # offloaded and released, but the block is kept on device (tensor cache)
    FREED = "freed"  # gone for the rest of the iteration


class Move(Name):
    """A residency move: what an action does to one tensor's residency. The keys of
    :data:`TRANSITIONS`; each plan action declares one (``Action.move``, whose effects on
    blocks and the host link are :data:`~minidl.memory.ir.plan.EFFECTS`). Members are their
    strings (:class:`.names.Name`)."""

    ALLOCATE = "allocate"
    REALLOCATE = "reallocate"
    OFFLOAD = "offload"
    RELEASE = "release"
    KEEP_CACHED = "keep_cached"
    EVICT = "evict"
    REUSE_CACHED = "reuse_cached"
    PREFETCH = "prefetch"
    AWAIT_PREFETCH = "await_prefetch"
    FREE = "free"


#: Every legal transition: (state, move) -> the state it leads to. Anything else is illegal.
TRANSITIONS: dict[tuple[Residency, Move], Residency] = {
    (Residency.UNALLOCATED, Move.ALLOCATE): Residency.ON_DEVICE,
    # a plan may free a tensor and allocate it again later: a new block, no old contents
    (Residency.FREED, Move.ALLOCATE): Residency.ON_DEVICE,
    (Residency.ON_DEVICE, Move.REALLOCATE): Residency.ON_DEVICE,
    (Residency.ON_DEVICE, Move.OFFLOAD): Residency.OFFLOADING,
    (Residency.OFFLOADING, Move.RELEASE): Residency.ON_HOST,
    (Residency.OFFLOADING, Move.KEEP_CACHED): Residency.CACHED,
    (Residency.CACHED, Move.EVICT): Residency.ON_HOST,
    (Residency.CACHED, Move.REUSE_CACHED): Residency.PREFETCHING,
    (Residency.ON_HOST, Move.PREFETCH): Residency.PREFETCHING,
    (Residency.PREFETCHING, Move.AWAIT_PREFETCH): Residency.ON_DEVICE,
    (Residency.ON_DEVICE, Move.FREE): Residency.FREED,
    (Residency.OFFLOADING, Move.FREE): Residency.FREED,
    (Residency.ON_HOST, Move.FREE): Residency.FREED,
    (Residency.PREFETCHING, Move.FREE): Residency.FREED,
    (Residency.CACHED, Move.FREE): Residency.FREED,
}

#: Every action a record accepts (the names of its transition methods).
ACTIONS: tuple[Move, ...] = tuple(dict.fromkeys(move for _, move in TRANSITIONS))

#: States in which a tensor has been offloaded and is not yet back (a swap is under way).
SWAPPED_OUT = frozenset({Residency.OFFLOADING, Residency.CACHED, Residency.ON_HOST,
                         Residency.PREFETCHING})


class IllegalTransition(RuntimeError):
    """A residency action that the tensor's current state does not allow."""

    def __init__(self, name: str, state: Residency, action: str) -> None:
        allowed = sorted(a for (s, a) in TRANSITIONS if s is state)
        super().__init__(f"tensor {name} is {state.value}: cannot {action} it (allowed: "
                         f"{', '.join(allowed) or 'nothing'})")
        self.name, self.state, self.action = name, state, action


@dataclass(eq=False, slots=True)
class SwapState:
    """What a swap of one tensor holds: the ``host`` buffer, the ``d2h``/``h2d`` copy events,
    ``nbytes`` of the block being swapped and ``saved_shape``, the shape of the view to restore
    after it (an encoded stash's view may differ from the planned shape)."""

    host: Any = None
    d2h: Any = None
    h2d: Any = None
    nbytes: int = 0
    saved_shape: tuple[int, ...] | None = None


@dataclass(eq=False, slots=True)
class TensorRecord:
    """One tensor's residency and what that state owns.

    ``block`` is the device block (roots only), ``view`` the array steps read (absent unless
    the tensor is readable), ``swap`` the host side of a swap (:class:`SwapState`),
    ``members`` the live aliases of a root (they lose and regain their views with it).
    """

    tensor: int
    name: str
    state: Residency = Residency.UNALLOCATED
    block: Any = None
    view: Any = None
    swap: SwapState = field(default_factory=SwapState)
    members: set[int] = field(default_factory=set)

    def check(self, move: Move) -> Residency:
        """The state ``move`` leads to from here; raises :class:`IllegalTransition`."""
        try:
            return TRANSITIONS[(self.state, move)]
        except KeyError:
            raise IllegalTransition(self.name, self.state, move) from None

    def allocate(self, block: Any, view: Any) -> None:
        """On device in ``block`` (None for an alias), readable as ``view`` (None for an alias
        whose root is away)."""
        self.state = self.check(Move.ALLOCATE)
        self.block, self.view = block, view

    def reallocate(self, block: Any, view: Any) -> None:
        """The device block replaced by ``block`` (the caller frees the old one)."""
        self.state = self.check(Move.REALLOCATE)
        self.block, self.view = block, view

    def offload(self, host: Any, event: Any) -> None:
        """Being copied into ``host`` (``event`` completes the copy); not readable meanwhile."""
        self.state = self.check(Move.OFFLOAD)
        swap = self.swap
        swap.host, swap.d2h, swap.nbytes = host, event, self.block.size
        self.view = None

    def release(self) -> None:
        """The device block is gone (the caller freed it); the host copy remains."""
        self.state = self.check(Move.RELEASE)
        self.block = None

    def keep_cached(self) -> None:
        """Released, but the block stays on device until evicted or reused."""
        self.state = self.check(Move.KEEP_CACHED)

    def evict(self) -> None:
        """The cached block is gone (the caller freed it); the host copy remains."""
        self.state = self.check(Move.EVICT)
        self.block = None

    def reuse_cached(self) -> None:
        """A prefetch found the block still cached: back without a copy."""
        self.state = self.check(Move.REUSE_CACHED)
        self.swap.h2d = None

    def prefetch(self, block: Any, event: Any) -> None:
        """Copying back into ``block`` (``event`` completes the copy)."""
        self.state = self.check(Move.PREFETCH)
        self.block, self.swap.h2d = block, event

    def await_prefetch(self, view: Any) -> None:
        """The copy back is complete (the caller waited and returned the host buffer)."""
        self.state = self.check(Move.AWAIT_PREFETCH)
        self.view, self.swap.host = view, None

    def free(self) -> None:
        """Gone for the rest of the iteration (the caller returned the block and host buffer)."""
        self.state = self.check(Move.FREE)
        self.block = self.view = None
        swap = self.swap
        swap.host = swap.d2h = swap.h2d = None
