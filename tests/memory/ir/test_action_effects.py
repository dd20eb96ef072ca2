"""One action vocabulary: every plan action is of one ActionKind, and EFFECTS (by kind) is the
one table of what it does — its residency move, block start / end, host-link copy; the plan
readers outside memory/ read plans through walk() and dispatch on that table."""

import ast
import inspect

from minidl.analysis import memory_record, summary
from minidl.memory.ir import plan as plan_module
from minidl.memory.ir.plan import (
    ACTIONS,
    EFFECTS,
    ENDING_KINDS,
    ENDS,
    STARTS,
    ActionKind,
    Alloc,
    Await,
    Free,
    Offload,
    Prefetch,
    Release,
)
from minidl.memory.ir.residency import TRANSITIONS, Move
from minidl.memory.runtime import runtime


def test_every_kind_has_one_action_and_one_effect():
    assert sorted(a.kind for a in ACTIONS) == sorted(ActionKind)
    assert set(EFFECTS) == set(ActionKind)
    moves = {m for _, m in TRANSITIONS}
    for kind, effect in EFFECTS.items():
        assert isinstance(effect.move, Move) and effect.move in moves, kind
        assert not (effect.starts_block and effect.ends_block)


def test_the_table_says_what_each_action_does():
    assert STARTS == (Alloc, Prefetch) and ENDS == (Free, Release)
    assert ENDING_KINDS == {"free", "release"}
    assert Offload(0).effect.copy == "d2h" and Prefetch(0).effect.copy == "h2d"
    assert [a(0).effect.copy for a in (Alloc, Free, Release, Await)] == [None] * 4
    assert Await(0).move is Move.AWAIT_PREFETCH and Alloc(0, 64).move is Move.ALLOCATE
    # the kinds are the names the runtime logs actions by (a snapshot's action column)
    assert [f"{a.kind}" for a in ACTIONS] == ["alloc", "free", "offload", "release",
                                              "prefetch", "await"]


def _attributes(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def test_plan_readers_walk_and_dispatch_on_the_table():
    for module in (summary, memory_record):
        attrs = _attributes(module)
        assert not attrs & {"begin", "before", "after"}, module.__name__  # walk() reads them
        assert "walk" in inspect.getsource(module)
    for module in (memory_record, runtime, plan_module):
        assert "__name__.lower()" not in inspect.getsource(module), module.__name__
    assert not {"Alloc", "Prefetch", "Free", "Release"} & set(vars(summary))
