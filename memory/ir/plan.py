"""Plans are data: per step, the memory actions to run before and after its compute.

Actions are typed records (:data:`Action`), carried out by
:class:`~minidl.memory.runtime.runtime.MemoryRuntime`. A :class:`Plan` is frozen: a pass that
changes
a plan returns a new one (:func:`dataclasses.replace`), so a plan once made never changes
under the executor that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Union

from .program import Program


@dataclass(frozen=True)
class Alloc:
    """Put ``tensor`` (a block, or a view of its alias's block) on the device, at ``offset``
    when a static plan placed it (-1: the pool chooses)."""

    tensor: int
    offset: int = -1
    op: ClassVar[str] = "alloc"


@dataclass(frozen=True)
class Free:
    """Return ``tensor``'s block (or drop its alias view)."""

    tensor: int
    op: ClassVar[str] = "free"


@dataclass(frozen=True)
class Offload:
    """Start copying ``tensor``'s block to host memory (the copy engine; asynchronous)."""

    tensor: int
    op: ClassVar[str] = "offload"


@dataclass(frozen=True)
class Release:
    """Wait for ``tensor``'s offload, then free its device block (or keep it cached)."""

    tensor: int
    op: ClassVar[str] = "release"


@dataclass(frozen=True)
class Prefetch:
    """Allocate ``tensor``'s block again (at ``offset`` if planned) and start copying it back."""

    tensor: int
    offset: int = -1
    op: ClassVar[str] = "prefetch"


@dataclass(frozen=True)
class Await:
    """Wait until ``tensor``'s prefetch has arrived (the stall, if any)."""

    tensor: int
    op: ClassVar[str] = "await"


#: Every memory action a plan can hold.
Action = Union[Alloc, Free, Offload, Release, Prefetch, Await]  # noqa: UP007 - a runtime alias
ACTIONS = (Alloc, Free, Offload, Release, Prefetch, Await)
#: Actions that put a block on the device, and those that take it off.
STARTS = (Alloc, Prefetch)
ENDS = (Free, Release)


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


@dataclass(frozen=True)
class Plan:
    """What to do with memory around every step of a program.

    ``begin`` runs before the first step and ``end`` after the last. ``aliases`` maps a tensor
    to the tensor whose memory it shares (in-place ops); an aliased tensor is never allocated
    or freed itself (read-only, as the whole plan). ``notes`` are human-readable facts about
    the policy's choices.
    """

    program: Program
    steps: tuple[StepPlan, ...]
    begin: tuple[Action, ...] = ()
    end: tuple[Action, ...] = ()
    aliases: dict[int, int] = None  # type: ignore[assignment]  # set in __post_init__
    spec: str = "none"
    notes: tuple[str, ...] = ()
    #: For static plans: bytes of the planned arena above ``static_base`` (else -1).
    static_arena: int = -1
    static_base: int = -1
    #: Blocks the plan swaps to host, and whether released blocks stay cached on device.
    swapped: tuple[int, ...] = ()
    cache: bool = False
    #: True once the plan was made from measured step times (``swap=auto``, ``auto``).
    measured: bool = False
    #: False while sparse block sizes rest on an assumed density (see :mod:`.compress`).
    densities_measured: bool = True
    #: The auto planner's decisions, if any.
    auto: AutoChoice | None = None

    def __post_init__(self) -> None:
        # normalise containers to immutable ones (callers may build with lists)
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "begin", tuple(self.begin))
        object.__setattr__(self, "end", tuple(self.end))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "swapped", tuple(self.swapped))
        object.__setattr__(self, "aliases", dict(self.aliases or {}))

    def with_notes(self, *notes: str, first: bool = False) -> Plan:
        """This plan with ``notes`` added (at the front with ``first``)."""
        return replace(self, notes=(*notes, *self.notes) if first else (*self.notes, *notes))

    def actions(self):
        """Every action in execution order, as (position, action); position -1 is ``begin``,
        ``len(steps)`` is ``end``."""
        for a in self.begin:
            yield -1, a
        for i, sp in enumerate(self.steps):
            for a in sp.before:
                yield i, a
            for a in sp.after:
                yield i, a
        for a in self.end:
            yield len(self.steps), a

    def validate(self) -> None:
        """Every non-persistent tensor a step touches is allocated before and freed after, once;
        a swapped one is offloaded, released, prefetched and awaited in that order."""
        prog = self.program
        live: set[int] = set()
        freed: set[int] = set()
        away: dict[int, str] = {}  # swapped tensors: offloading | on host | prefetching

        def root(t: int) -> int:
            while t in self.aliases:
                t = self.aliases[t]
            return t

        def apply(a: Action, where: str) -> None:
            if isinstance(a, Alloc):
                if a.tensor in live or a.tensor in freed:
                    raise AssertionError(f"{where}: tensor {a.tensor} allocated twice")
                live.add(a.tensor)
            elif isinstance(a, Free):
                if a.tensor not in live:
                    raise AssertionError(f"{where}: tensor {a.tensor} freed while not live")
                live.discard(a.tensor)
                freed.add(a.tensor)
            elif isinstance(a, Offload):
                if a.tensor not in live:
                    raise AssertionError(f"{where}: offload of {a.tensor} while not live")
                live.discard(a.tensor)
                away[a.tensor] = "offloading"
            elif isinstance(a, (Release, Prefetch, Await)):
                # a swapped tensor goes offloading -> (release) on host -> (prefetch)
                # prefetching -> (await) live, in that order
                need, after = {Release: ("offloading", "on host"),
                               Prefetch: ("on host", "prefetching"),
                               Await: ("prefetching", None)}[type(a)]
                if a.tensor not in away:
                    raise AssertionError(f"{where}: {a.op} of {a.tensor} never offloaded")
                if away[a.tensor] != need:
                    raise AssertionError(f"{where}: {a.op} of {a.tensor} while "
                                         f"{away[a.tensor]} (needs {need})")
                if after is None:
                    del away[a.tensor]
                    live.add(a.tensor)
                else:
                    away[a.tensor] = after

        for a in self.begin:
            apply(a, "begin")
        for i, (st, sp) in enumerate(zip(prog.steps, self.steps)):
            for a in sp.before:
                apply(a, f"step {i} before")
            touched = set(st.reads) | set(st.writes)
            if st.workspace >= 0:
                touched.add(st.workspace)
            for t in touched:
                if prog.tensors[t].persistent:
                    continue
                if root(t) not in live:
                    raise AssertionError(
                        f"step {i} ({st.label}) touches {prog.tensors[t].name} which is not live"
                    )
            for a in sp.after:
                apply(a, f"step {i} after")
        for a in self.end:
            apply(a, "end")
        if live:
            names = sorted(prog.tensors[t].name for t in live)
            raise AssertionError(f"tensors still live at the end: {names[:5]}")
        if away:
            names = sorted(prog.tensors[t].name for t in away)
            raise AssertionError(f"tensors offloaded and never brought back: {names[:5]}")
