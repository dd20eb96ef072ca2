"""One rank's figures of a data-parallel dry run: what ZeRO leaves each rank of the training
state, the breakdown and the tensors live at the peak as that rank holds them, and the report
of its collectives."""

from __future__ import annotations

import math
from typing import Any

from ..memory.ir.names import Role
from ..memory.passes.zero import STAGES, ZeroBytes, owned_ranges

#: The roles whose persistent tensors ZeRO ``stage`` shards.
SHARDED_ROLES = {1: ("opt_state",), 2: ("opt_state", "param_grad"),
                 3: ("opt_state", "param_grad", "param")}


def zero_what(stage: int) -> str:
    """What ZeRO ``stage`` shards, in words."""
    return STAGES.get(stage, "nothing")


def rank_breakdown(prog: Any, zero: ZeroBytes, breakdown: dict[str, int]) -> dict[str, int]:
    """The breakdown at the peak as rank ``zero.rank`` holds it: the program's persistent bytes
    of each category replaced by the rank's (:func:`~minidl.memory.passes.zero.zero_bytes`),
    stage 3's gathered parameter block added where the program has none. It then sums to the
    rank's peak."""
    program_bytes: dict[str, int] = {}
    for t in prog.tensors:
        if t.persistent:
            program_bytes[t.category] = program_bytes.get(t.category, 0) + \
                prog.block_size(t.nbytes)
    out = dict(breakdown)
    for cat in set(program_bytes) | set(zero.persistent):
        out[cat] = out.get(cat, 0) - program_bytes.get(cat, 0) + zero.persistent.get(cat, 0)
    if zero.gather_bytes and not zero.gathered_in_program:
        out["parameter"] = out.get("parameter", 0) + zero.gather_bytes
    return {k: v for k, v in out.items() if v}


def rank_live_tensors(prog: Any, zero: ZeroBytes, live: list[tuple[str, str, int]]
                      ) -> list[tuple[str, str, int]]:
    """The tensors live at the peak as rank ``zero.rank`` holds them, largest first: each
    sharded tensor by its shard on the rank (left out where the rank owns none of it)."""
    trainable = [t for t in prog.tensors if t.role == Role.PARAM_GRAD]
    sizes = [math.prod(t.shape) for t in trainable]
    shard = {i: prog.block_size((hi - lo) * (trainable[i].nbytes // max(sizes[i], 1)))
             for i, lo, hi in owned_ranges(sizes, zero.ranks, zero.rank)}
    index = {t.name[:-len(".grad")]: i for i, t in enumerate(trainable)}
    sharded_roles = SHARDED_ROLES.get(zero.stage, ())
    by_name = {t.name: t for t in prog.tensors}
    rows = []
    for name, cat, nbytes in live:
        t = by_name.get(name)
        if t is not None and t.persistent and t.role in sharded_roles:
            base = name if t.role == Role.PARAM else name.rsplit(".", 1)[0]
            i = index.get(base)
            if i is not None:
                nbytes = shard.get(i, 0)
        if nbytes:
            rows.append((name, cat, nbytes))
    rows.sort(key=lambda r: -r[2])
    return rows


def zero_report(z: ZeroBytes) -> dict[str, Any]:
    """The report's ``zero`` entry: the rank's persistent bytes and its collectives."""
    return {"stage": z.stage, "persistent_bytes": dict(z.persistent),
            "unsharded_bytes": dict(z.unsharded), "saved_bytes": z.saved_bytes,
            "gather_bytes": z.gather_bytes,
            "collectives": [{"name": c.name, "payload_bytes": c.payload_bytes,
                             "sent_bytes_per_rank": c.sent_bytes} for c in z.collectives]}
