"""Block sharing between a step's output and one of its operands, when liveness proves the
operand dead after that step. The mechanism behind ``inplace`` (forward) and ``reuse``'s
intra-layer gradient reuse (backward)."""

from __future__ import annotations

from ..ir.liveness import Lifetime, root_of
from ..ir.program import Program


def share_blocks(program: Program, life: dict[int, Lifetime], phases: set[str],
                 aliases: dict[int, int] | None = None,
                 keep: set[int] | None = None) -> dict[int, int]:
    """Extend ``aliases`` with every ``step.access.shares`` pair of a step in ``phases`` whose read
    operand's block is dead after that step.

    A pair (written, read) is taken when both have the same size and dtype, the read operand
    is neither fed nor persistent nor kept, and the last use of every tensor already sharing
    its block is this step. The written tensor then joins that block's group.
    """
    aliases = dict(aliases or {})
    keep = keep or set()
    group_last: dict[int, int] = {}
    for t, lt in life.items():
        r = root_of(aliases, t)
        group_last[r] = max(group_last.get(r, -1), lt.last)
    fed = set(program.inputs)
    heads = {root_of(aliases, t) for t in aliases}
    for st in program.steps:
        if st.phase not in phases:
            continue
        for written, read in st.access.shares:
            tw, tr = program.tensors[written], program.tensors[read]
            if written in aliases or written == read:
                continue
            if tw.nbytes != tr.nbytes or tw.dtype != tr.dtype:
                continue
            r = root_of(aliases, read)
            if r in fed or read in fed or tr.persistent or r in keep or read in keep:
                continue
            if group_last.get(r, -2) != st.index:
                continue
            if written in heads:  # the written tensor heads a group of its own already
                continue
            aliases[written] = read
            heads.add(r)
            group_last[r] = max(group_last[r], group_last.pop(written, life[written].last))
    return aliases
