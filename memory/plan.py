"""Plans are data: per step, the memory actions to run before and after its compute."""

from __future__ import annotations

from dataclasses import dataclass, field

from .program import Program

#: Memory actions the runtime understands. ``offload`` / ``release`` / ``prefetch`` /
#: ``await`` move a block to host memory and back (see :mod:`.swap`).
ACTIONS = ("alloc", "free", "offload", "release", "prefetch", "await")


@dataclass(frozen=True)
class Action:
    """One memory action on one tensor (``op`` in :data:`ACTIONS`). ``arg`` carries an
    op-specific detail (e.g. a planned offset for a static plan, or the tensor an in-place
    output aliases)."""

    op: str
    tensor: int
    arg: int = -1

    def __repr__(self) -> str:
        return f"{self.op}({self.tensor}{'' if self.arg < 0 else f', {self.arg}'})"


@dataclass
class StepPlan:
    before: list[Action] = field(default_factory=list)
    after: list[Action] = field(default_factory=list)


@dataclass
class Plan:
    """What to do with memory around every step of a program.

    ``begin`` runs before the first step and ``end`` after the last. ``aliases`` maps a tensor
    to the tensor whose memory it shares (in-place ops); an aliased tensor is never allocated
    or freed itself. ``notes`` are human-readable facts about the policy's choices.
    """

    program: Program
    steps: list[StepPlan]
    begin: list[Action] = field(default_factory=list)
    end: list[Action] = field(default_factory=list)
    aliases: dict[int, int] = field(default_factory=dict)
    spec: str = "none"
    notes: list[str] = field(default_factory=list)
    #: For static plans: bytes of the planned arena above ``static_base`` (else -1).
    static_arena: int = -1
    static_base: int = -1
    #: Blocks the plan swaps to host, and whether released blocks stay cached on device.
    swapped: list[int] = field(default_factory=list)
    cache: bool = False
    #: True once the plan was made from measured step times (``swap=auto``, ``auto``).
    measured: bool = False
    #: False while sparse block sizes rest on an assumed density (see :mod:`.compress`).
    densities_measured: bool = True
    #: The auto planner's decisions (:class:`~minidl.memory.auto.AutoChoice`), if any.
    auto: object = None

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
        """Every non-persistent tensor a step touches is allocated before and freed after, once."""
        prog = self.program
        live: set[int] = set()
        freed: set[int] = set()
        away: set[int] = set()

        def root(t: int) -> int:
            while t in self.aliases:
                t = self.aliases[t]
            return t

        def apply(a: Action, where: str) -> None:
            if a.op == "alloc":
                if a.tensor in live or a.tensor in freed:
                    raise AssertionError(f"{where}: tensor {a.tensor} allocated twice")
                live.add(a.tensor)
            elif a.op == "free":
                if a.tensor not in live:
                    raise AssertionError(f"{where}: tensor {a.tensor} freed while not live")
                live.discard(a.tensor)
                freed.add(a.tensor)
            elif a.op == "offload":
                if a.tensor not in live:
                    raise AssertionError(f"{where}: offload of {a.tensor} while not live")
                live.discard(a.tensor)
                away.add(a.tensor)
            elif a.op == "await":
                if a.tensor not in away:
                    raise AssertionError(f"{where}: await of {a.tensor} never offloaded")
                away.discard(a.tensor)
                live.add(a.tensor)

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
