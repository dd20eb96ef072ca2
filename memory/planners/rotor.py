"""Rotor's dynamic programme over a chain of stages (Beaumont, Eyraud-Dubois, Hermann, Joly,
Shilova 2019, "Optimal checkpointing for heterogeneous chains"): for every memory limit at
once, the least time of a training iteration whose stages are recomputed as often as the
limit needs (recomputation in chains, not only one level).

``C(i, l, m)``: the least time to run stages ``i..l`` forward and backward when the input of
stage ``i`` is stored, the gradient of stage ``l``'s output is held, and ``m`` bytes are free
for the rest. Either stage ``i`` runs keeping everything its backward needs, then ``i+1..l``
with that much less memory, then ``i``'s backward; or stages ``i..j-1`` run forward keeping
nothing but stage ``j``'s input, then ``j..l`` with that input stored, then ``i..j-1`` again
from the stored input of ``i``. The figures are the chain's (:class:`.chain.Stage`), in units
of ``unit`` bytes rounded up; every schedule the table gives is then written as a program and
priced and placed exactly (the table is how candidates are found, not what they cost).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chain import Chain

__all__ = ["RotorTable", "rotor_table", "rotor_schedule"]

#: "what" of a table cell: stage i runs keeping everything its backward reads (_CHAIN), or
#: keeping nothing and running its backward memory-centric (_LEAN); j > i: a leaf checkpoint.
_CHAIN, _LEAN = -1, -2


@dataclass(frozen=True)
class RotorTable:
    """The programme's table: ``cost[i][l]`` (seconds, a vector over memory slots; inf where
    nothing fits) and ``what[i][l]`` (the choice at each slot), for ``unit`` bytes a slot."""

    chain: Chain
    unit: int
    slots: int
    cost: dict[tuple[int, int], np.ndarray]
    what: dict[tuple[int, int], np.ndarray]

    def least_slots(self) -> int | None:
        """The fewest slots the whole chain runs in (None: it does not fit the table)."""
        c = self.cost[(0, len(self.chain) - 1)]
        ok = np.flatnonzero(np.isfinite(c))
        return int(ok[0]) if ok.size else None


def _units(nbytes: int, unit: int, up: bool = True) -> int:
    return -(-int(nbytes) // unit) if up else int(nbytes) // unit


@dataclass(frozen=True)
class _StageSlots:
    """A chain's memory figures in slots, per stage ``k``: ``x[k]`` its input (``x[n]``: the
    loss), ``g[k]`` its input's gradient, ``kb[k]`` what it keeps for backward (its output
    included), ``ft`` / ``bt`` / ``lbt`` its forward, backward and memory-centric backward
    extras, ``grads[k]`` / ``kept_back[k]`` what its backward holds beside them."""

    x: list[int]
    g: list[int]
    kb: list[int]
    ft: list[int]
    bt: list[int]
    lbt: list[int]
    grads: list[int]
    kept_back: list[int]


@dataclass(frozen=True)
class _StageTimes:
    """A chain's times per stage: forward (``uf``), backward (``ub``) and memory-centric
    recompute (``lean_s``), and the forward times' prefix sums."""

    uf: np.ndarray
    ub: np.ndarray
    lean_s: np.ndarray
    prefix: np.ndarray


def _stage_slots(chain: Chain, unit: int, bound: bool) -> _StageSlots:
    """The chain's memory figures in slots of ``unit`` bytes: rounded up, or with ``bound``
    rounded down and each at its least (kept stashes encoded, inputs nobody reads free)."""
    n = len(chain)
    sizes = [s.sizes for s in chain.stages]
    up = not bound
    x = [_units(s.input, unit, up) for s in sizes] + [0]  # x[k]: stage k's input (x[n]: loss)
    # gradient of stage k's input: the chain's figure (none for the fed input), else its size
    g = ([_units(b, unit, up) for b in chain.grad_bytes] + [0]) if chain.grad_bytes \
        else list(x)
    kb = [_units(s.kept, unit, up) + x[k + 1] for k, s in enumerate(sizes)]
    # during a stage's backward: the gradients of its input and output (a bound: the larger
    # only, as when one is written over the other) and what it kept (a bound: not its output)
    if bound:
        x = [v if k == 0 or k == n or chain.stages[k].input_read_back else 0
             for k, v in enumerate(x)]
        kb = [_units(s.kept_least, unit, up) + x[k + 1] for k, s in enumerate(sizes)]
        grads = [max(g[k], g[k + 1]) for k in range(n)]
        kept_back = [_units(s.kept_least, unit, up) for s in sizes]
    else:
        grads = [g[k] + g[k + 1] for k in range(n)]
        kept_back = kb
    return _StageSlots(
        x=x, g=g, kb=kb, ft=[_units(s.forward_extra, unit, up) for s in sizes],
        bt=[_units(s.backward_extra, unit, up) for s in sizes],
        lbt=[_units(s.lean.extra, unit, up) for s in chain.stages], grads=grads,
        kept_back=kept_back)


def _stage_times(chain: Chain) -> _StageTimes:
    """The chain's times per stage, and the forward times' prefix sums."""
    uf = np.array([s.seconds.forward for s in chain.stages])
    return _StageTimes(uf=uf, ub=np.array([s.seconds.backward for s in chain.stages]),
                       lean_s=np.array([s.lean.recompute_s for s in chain.stages]),
                       prefix=np.concatenate([[0.0], np.cumsum(uf)]))


def rotor_table(chain: Chain, unit: int, slots: int, bound: bool = False) -> RotorTable:
    """Fill the programme's table for memory limits of ``0..slots`` slots of ``unit`` bytes.
    ``bound=True``: every figure rounded down to slots (the table's times are then a lower
    bound for its schedules, where the figures are)."""
    n = len(chain)
    f = _stage_slots(chain, unit, bound)
    x, g, kb, ft, bt, lbt, grads, kept_back = f.x, f.g, f.kb, f.ft, f.bt, f.lbt, f.grads, \
        f.kept_back
    times = _stage_times(chain)
    uf, ub, lean_s, prefix = times.uf, times.ub, times.lean_s, times.prefix
    m = np.arange(slots + 1)
    inf = np.full(slots + 1, np.inf)
    cost: dict[tuple[int, int], np.ndarray] = {}
    what: dict[tuple[int, int], np.ndarray] = {}

    def shifted(v: np.ndarray, by: int) -> np.ndarray:
        """``v(m - by)`` (inf where ``m < by``)."""
        if by <= 0:
            return v
        out = inf.copy()
        if by <= slots:
            out[by:] = v[:slots + 1 - by]
        return out

    def base(k: int, held: int) -> np.ndarray:
        need = max(held + kb[k] + ft[k], grads[k] + kept_back[k] + bt[k])
        return np.where(m >= need, uf[k] + ub[k], np.inf)

    def lean(k: int, held: int) -> np.ndarray:
        """Stage k run keeping only its output, its backward memory-centric."""
        need = max(held + x[k + 1] + ft[k], grads[k] + lbt[k])
        return np.where(m >= need, uf[k] + ub[k] + lean_s[k], np.inf)

    def lean_again(k: int) -> np.ndarray:
        """Stage k's backward memory-centric, its forward already run (a range ending before
        the last stage is a rerun: its output's gradient is held, its output was used)."""
        need = grads[k] + lbt[k]
        return np.where(m >= need, ub[k] + lean_s[k], np.inf)

    # sweep[i][j]: most slots a forward run of stages i..j-1 holds (input i stored elsewhere)
    for d in range(n):
        for i in range(n - d):
            l = i + d
            held = g[l + 1]
            if d == 0:
                full = base(i, held)
                thin = lean(i, held) if l == n - 1 else lean_again(i)
                cost[(i, l)] = np.minimum(full, thin)
                what[(i, l)] = np.where(thin < full, _LEAN, _CHAIN).astype(np.int32)
                continue
            best = shifted(cost[(i + 1, l)], kb[i]) + base(i, held)
            choice = np.full(slots + 1, _CHAIN, np.int32)
            thin = shifted(cost[(i + 1, l)], x[i + 1]) + lean(i, held)
            choice = np.where(thin < best, _LEAN, choice)
            best = np.minimum(best, thin)
            sweep = 0
            for j in range(i + 1, l + 1):
                s = j - 1  # stage s runs forward in the sweep: its input (not i's) and output
                sweep = max(sweep, (x[s] if s > i else 0) + x[s + 1] + ft[s])
                cand = (prefix[j] - prefix[i]) + shifted(cost[(j, l)], x[j]) + cost[(i, j - 1)]
                cand = np.where(m >= held + sweep, cand, np.inf)
                better = cand < best
                best = np.where(better, cand, best)
                choice = np.where(better, j, choice)
            cost[(i, l)] = best
            what[(i, l)] = choice
    return RotorTable(chain, unit, slots, cost, what)


def rotor_schedule(table: RotorTable, slots: int) -> list[tuple[str, int]]:
    """The operations (``("f", k)`` forward runs and ``("b", k)`` backwards) of the table's
    schedule with ``slots`` slots free (it must fit: ``cost[(0, n-1)][slots]`` finite)."""
    chain = table.chain
    n = len(chain)
    if not np.isfinite(table.cost[(0, n - 1)][min(slots, table.slots)]):
        raise ValueError(f"the chain does not run in {slots} slots of {table.unit} bytes")
    x = [_units(s.sizes.input, table.unit) for s in chain.stages] + [0]
    kb = [_units(s.sizes.kept, table.unit) + x[k + 1] for k, s in enumerate(chain.stages)]
    ops: list[tuple[str, int]] = []
    stack: list[tuple[int, int, int] | tuple[str, int]] = [(0, n - 1, min(slots, table.slots))]
    while stack:
        item = stack.pop()
        if isinstance(item[0], str):
            ops.append(item)  # type: ignore[arg-type]
            continue
        i, l, mm = item  # type: ignore[misc]
        j = int(table.what[(i, l)][mm])
        if i == l:  # (a lean backward in a rerun needs no forward run: see lean_again)
            ops += [("m", i)] if j == _LEAN and l < n - 1 else [("f", i), ("m" if j == _LEAN
                                                                          else "b", i)]
            continue
        if j == _CHAIN:  # i keeps everything; then i+1..l; then i's backward
            ops.append(("f", i))
            stack += [("b", i), (i + 1, l, mm - kb[i])]
        elif j == _LEAN:  # i keeps its output only; then i+1..l; then i's lean backward
            ops.append(("f", i))
            stack += [("m", i), (i + 1, l, mm - x[i + 1])]
        else:  # i..j-1 forward keeping j's input; j..l; then i..j-1 again
            ops += [("f", s) for s in range(i, j)]
            stack += [(i, j - 1, mm), (j, l, mm - x[j])]
    return ops
