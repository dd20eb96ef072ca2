"""Plans are data: per step, the memory actions to run before and after its compute.

Actions are typed records (:data:`Action`), carried out by
:class:`~minidl.memory.runtime.runtime.MemoryRuntime`. Each declares the residency move it
is of one :class:`ActionKind`, and :data:`EFFECTS`, the one table every reader of actions
dispatches on, says by kind what it does: the residency move it makes (a
:class:`.residency.Move`, a key of :data:`.residency.TRANSITIONS`, the one table of legal
moves, which both the runtime and :meth:`Plan.validate` follow), whether it puts a block on
the device or takes one off, and the host-link copy it starts. A :class:`Plan` is frozen: a
pass that changes a plan returns a new one (:func:`dataclasses.replace`), so a plan once made
never changes under the executor that runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple, Union

from .names import Name
from .program import Program
from .residency import SWAPPED_OUT, TRANSITIONS, Move, Residency
from .walk import Where, walk


class ActionKind(Name):
    """The kinds of plan action; each member is the name the runtime logs the action by (the
    snapshot's ``action`` column)."""

    ALLOC = "alloc"
    FREE = "free"
    OFFLOAD = "offload"
    RELEASE = "release"
    PREFETCH = "prefetch"
    AWAIT = "await"


class Effect(NamedTuple):
    """What an action of one kind does: the residency move it makes, whether it puts a device
    block on (``starts_block``) or takes one off (``ends_block``), and the host-link copy it
    starts (``"d2h"`` / ``"h2d"``, or None)."""

    move: Move
    starts_block: bool = False
    ends_block: bool = False
    copy: str | None = None


#: The one table of what plan actions do, by kind.
EFFECTS: dict[ActionKind, Effect] = {
    ActionKind.ALLOC: Effect(Move.ALLOCATE, starts_block=True),
    ActionKind.FREE: Effect(Move.FREE, ends_block=True),
    ActionKind.OFFLOAD: Effect(Move.OFFLOAD, copy="d2h"),
    ActionKind.RELEASE: Effect(Move.RELEASE, ends_block=True),
    ActionKind.PREFETCH: Effect(Move.PREFETCH, starts_block=True, copy="h2d"),
    ActionKind.AWAIT: Effect(Move.AWAIT_PREFETCH),
}
#: The kinds that take a block off the device (the runtime's block events carry these names).
ENDING_KINDS = frozenset(k for k, e in EFFECTS.items() if e.ends_block)


class _Action:
    """What every action reads from :data:`EFFECTS` through its ``kind``."""

    __slots__ = ()
    kind: ClassVar[ActionKind]

    @property
    def effect(self) -> Effect:
        return EFFECTS[self.kind]

    @property
    def move(self) -> Move:
        """The residency move the action makes (:data:`.residency.TRANSITIONS`)."""
        return EFFECTS[self.kind].move


@dataclass(frozen=True)
class Alloc(_Action):
    """Put ``tensor`` (a block, or a view of its alias's block) on the device, at ``offset``
    when a static plan placed it (-1: the pool chooses)."""

    tensor: int
    offset: int = -1
    kind: ClassVar[ActionKind] = ActionKind.ALLOC


@dataclass(frozen=True)
class Free(_Action):
    """Return ``tensor``'s block (or drop its alias view)."""

    tensor: int
    kind: ClassVar[ActionKind] = ActionKind.FREE


@dataclass(frozen=True)
class Offload(_Action):
    """Start copying ``tensor``'s block to host memory (the copy engine; asynchronous)."""

    tensor: int
    kind: ClassVar[ActionKind] = ActionKind.OFFLOAD


@dataclass(frozen=True)
class Release(_Action):
    """Wait for ``tensor``'s offload, then free its device block (or keep it cached)."""

    tensor: int
    kind: ClassVar[ActionKind] = ActionKind.RELEASE


@dataclass(frozen=True)
class Prefetch(_Action):
    """Allocate ``tensor``'s block again (at ``offset`` if planned) and start copying it back."""

    tensor: int
    offset: int = -1
    kind: ClassVar[ActionKind] = ActionKind.PREFETCH


@dataclass(frozen=True)
class Await(_Action):
    """Wait until ``tensor``'s prefetch has arrived (the stall, if any)."""

    tensor: int
    kind: ClassVar[ActionKind] = ActionKind.AWAIT


#: Every memory action a plan can hold.
Action = Union[Alloc, Free, Offload, Release, Prefetch, Await]  # noqa: UP007 - a runtime alias
ACTIONS = (Alloc, Free, Offload, Release, Prefetch, Await)
#: Actions that put a block on the device, and those that take it off (from :data:`EFFECTS`).
STARTS = tuple(a for a in ACTIONS if EFFECTS[a.kind].starts_block)
ENDS = tuple(a for a in ACTIONS if EFFECTS[a.kind].ends_block)


@dataclass(frozen=True)
class CurvePoint:
    """One point of the auto planner's curve (:mod:`.frontier`): a plan no other beats on
    both peak and predicted time. ``summary`` says what it does (e.g. ``"rotor: 9 of 56
    stages recomputed"``)."""

    peak: int
    time_s: float
    source: str
    summary: str = ""
    #: The frontier's lower bound at this point's peak (seconds; None: no certificate).
    lower_bound_s: float | None = None


@dataclass
class AutoChoice:
    """What the auto planner (:mod:`.auto`) decided: original value tensors swapped, forward
    steps dropped (recomputed in backward), and the resulting estimated overhead.
    ``early_release``: swapped blocks are released one step after their offload (compute
    waits for the copy) instead of when the copy has ended. ``only``: the one kind of action
    the planner was allowed (``"recompute"`` / ``"swap"``), or ``None``."""

    swapped: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    extra_time_s: float = 0.0
    peak: int = 0
    path: list[tuple[str, str, int, float]] = field(default_factory=list)
    early_release: bool = False
    only: str | None = None
    #: The frontier the frontier planner chose from, by increasing peak (empty for the
    #: greedy walk).
    curve: tuple[CurvePoint, ...] = ()
    #: A lower bound on the iteration time of any plan within the budget (seconds; None:
    #: no certificate for this program) and the oracle (no memory actions) time.
    lower_bound_s: float | None = None
    oracle_s: float | None = None


@dataclass(frozen=True)
class StepPlan:
    """The actions run before a step's compute and after it."""

    before: tuple[Action, ...] = ()
    after: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if type(self.before) is not tuple:
            object.__setattr__(self, "before", tuple(self.before))
        if type(self.after) is not tuple:
            object.__setattr__(self, "after", tuple(self.after))


class ChoiceKind(Name):
    """A per-op option chosen before planning (the names of
    :data:`~.capabilities.OPTIONS`)."""

    BPTT = "bptt"  # fused RNNs' BPTT schedule
    ATTENTION = "attn"  # attention's memory form
    CONV_WORKSPACE = "conv_ws"  # convolutions' workspace caps


@dataclass(frozen=True)
class Choice:
    """A per-op option chosen before planning and the note saying it (also in the plan's
    ``notes``): it stays with any later plan of the same program."""

    kind: ChoiceKind
    note: str


@dataclass(frozen=True)
class StaticLayout:
    """Where a static plan placed its blocks: ``arena`` bytes above ``base`` (both -1 for a
    plan whose blocks the pool places)."""

    arena: int = -1
    base: int = -1


@dataclass(frozen=True)
class Swapping:
    """The ``blocks`` a plan swaps to host, whether released blocks stay cached on device
    (``cache``: the tensor cache), and the tensors whose home is the host (``host_homed``:
    streamed parameters): each starts the iteration on the host, comes in by ``Prefetch`` /
    ``Await``, and an ``Offload`` of it copies nothing (its home holds its bytes already)."""

    blocks: tuple[int, ...] = ()
    cache: bool = False
    host_homed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("blocks", "host_homed"):
            if type(getattr(self, name)) is not tuple:
                object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class Provenance:
    """What a plan was made from: ``measured`` step times (``swap=auto``, ``auto``) or not,
    sparse block sizes from measured densities or (``densities_measured=False``) an assumed
    one (:mod:`.compress`), the auto planner's decisions (``auto``, if any) and the per-op
    options chosen before planning (``choices``, :meth:`Plan.with_choice`)."""

    measured: bool = False
    densities_measured: bool = True
    auto: AutoChoice | None = None
    choices: tuple[Choice, ...] = ()

    def __post_init__(self) -> None:
        if type(self.choices) is not tuple:
            object.__setattr__(self, "choices", tuple(self.choices))


@dataclass(frozen=True)
class Plan:
    """What to do with memory around every step of a program.

    ``begin`` runs before the first step and ``end`` after the last. ``aliases`` maps a tensor
    to the tensor whose memory it shares (in-place ops); an aliased tensor is never allocated
    or freed itself (read-only, as the whole plan). ``notes`` are human-readable facts about
    the policy's choices. ``static`` says where a static plan placed its blocks, ``swapping``
    what it swaps, ``provenance`` what it was made from.
    """

    program: Program
    steps: tuple[StepPlan, ...]
    begin: tuple[Action, ...] = ()
    end: tuple[Action, ...] = ()
    aliases: dict[int, int] = None  # type: ignore[assignment]  # set in __post_init__
    spec: str = "none"
    notes: tuple[str, ...] = ()
    static: StaticLayout = StaticLayout()
    swapping: Swapping = Swapping()
    provenance: Provenance = Provenance()

    def __post_init__(self) -> None:
        # normalise containers to immutable ones (callers may build with lists)
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "begin", tuple(self.begin))
        object.__setattr__(self, "end", tuple(self.end))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "aliases", dict(self.aliases or {}))

    def with_notes(self, *notes: str, first: bool = False) -> Plan:
        """This plan with ``notes`` added (at the front with ``first``)."""
        return replace(self, notes=(*notes, *self.notes) if first else (*self.notes, *notes))

    def with_choice(self, kind: ChoiceKind, note: str) -> Plan:
        """This plan with a per-op option chosen before planning, said by ``note`` (added to
        the notes too)."""
        made = self.provenance
        return replace(self, notes=(*self.notes, note), provenance=replace(
            made, choices=(*made.choices, Choice(ChoiceKind.of(kind), note))))

    def actions(self) -> Iterator[tuple[int, Action]]:
        """Every action in execution order (:func:`.walk.walk`), as (position, action);
        position -1 is ``begin``, ``len(steps)`` is ``end``."""
        for visit in walk(self):
            for a in visit.actions:
                yield visit.step, a

    def validate(self) -> None:
        """Every action is a legal move of its tensor's residency (:data:`.residency.TRANSITIONS`,
        the table the runtime follows; one rule on top: each tensor is allocated once), every
        non-persistent tensor a step touches is on the device, and at the end nothing is on the
        device or away on the host: raises AssertionError at the first violation."""
        check = _PlanCheck(self)
        for visit in walk(self):
            if visit.where is Where.COMPUTE:
                check.step_touches_live(visit.step)
            else:
                where = visit.where.label(visit.step)
                for a in visit.actions:
                    check.apply(a, where)
        check.nothing_left()


def residency_move(action: Action, state: Residency, cache: bool) -> Move:
    """The :data:`.residency.TRANSITIONS` move ``action`` makes on a tensor in ``state``:
    its declared ``move``, except that with the tensor cache (``Plan.swapping.cache``) a release
    keeps the block cached and a prefetch of a cached block reuses it."""
    move = action.move
    if cache and move is Move.RELEASE:
        return Move.KEEP_CACHED
    if move is Move.PREFETCH and state is Residency.CACHED:
        return Move.REUSE_CACHED
    return move


#: Moves the table allows that a plan must not make: a plan allocates each tensor once per
#: iteration (the passes never allocate a tensor they freed; the runtime's table would take it).
_PLAN_ONLY_FORBIDS = frozenset({(Move.ALLOCATE, Residency.FREED)})

#: What :meth:`Plan.validate` says for an illegal move, by the move and the state it met
#: (anything else: the table's own wording).
_MISTAKES: dict[tuple[Move, Residency], str] = {
    (Move.ALLOCATE, Residency.ON_DEVICE): "allocated twice",
    (Move.ALLOCATE, Residency.FREED): "allocated twice (freed before; a plan allocates a "
                                      "tensor once)",
    (Move.FREE, Residency.UNALLOCATED): "freed while not live (never allocated)",
    (Move.FREE, Residency.FREED): "freed while not live (freed already)",
}


class _PlanCheck:
    """:meth:`Plan.validate`'s state along the walk: one :class:`.residency.Residency` per
    tensor (unallocated until an action moves it), moved only by the transition table."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.state: dict[int, Residency] = dict.fromkeys(plan.swapping.host_homed,
                                                         Residency.ON_HOST)

    def apply(self, a: Action, where: str) -> None:
        """Carry out ``a`` (run at ``where``) on the state, or raise AssertionError."""
        t = a.tensor
        state = self.state.get(t, Residency.UNALLOCATED)
        move = residency_move(a, state, self.plan.swapping.cache)
        after = None if (move, state) in _PLAN_ONLY_FORBIDS else TRANSITIONS.get((state, move))
        if after is None:
            raise AssertionError(f"{where}: tensor {t} " + _MISTAKES.get(
                (move, state), f"is {state.value}: cannot {move} it (allowed: "
                f"{', '.join(sorted(m for s, m in TRANSITIONS if s is state)) or 'nothing'})"))
        self.state[t] = after

    def _root(self, t: int) -> int:
        aliases = self.plan.aliases
        while t in aliases:
            t = aliases[t]
        return t

    def step_touches_live(self, i: int) -> None:
        """Every non-persistent tensor step ``i`` reads or writes (or its workspace) is on the
        device (through its alias root)."""
        prog = self.plan.program
        st = prog.steps[i]
        touched = set(st.access.reads) | set(st.access.writes)
        if st.access.workspace >= 0:
            touched.add(st.access.workspace)
        for t in touched:
            if prog.tensors[t].persistent:
                continue
            if self.state.get(self._root(t)) is not Residency.ON_DEVICE:
                raise AssertionError(
                    f"step {i} ({st.label}) touches {prog.tensors[t].name} which is not live"
                )

    def nothing_left(self) -> None:
        """At the end, nothing is on the device and nothing is still away on the host."""
        tensors = self.plan.program.tensors
        live = [t for t, s in self.state.items() if s is Residency.ON_DEVICE]
        if live:
            names = sorted(tensors[t].name for t in live)
            raise AssertionError(f"tensors still live at the end: {names[:5]}")
        away = [t for t, s in self.state.items() if s in SWAPPED_OUT]
        if away:
            names = sorted(tensors[t].name for t in away)
            raise AssertionError(f"tensors offloaded and never brought back: {names[:5]}")
