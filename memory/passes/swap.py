"""``swap=conv|all|auto``: offload feature maps to host during forward, prefetch them back ahead
of their use in backward (vDNN, vDNN++, Capuchin).

The pass rewrites a liveness plan. For each swapped block (a tensor with everything sharing its
memory), with ``i`` its last forward use and ``j`` its first backward use:

* ``offload`` after step ``i``: an asynchronous device→host copy on the copy engine;
* ``release`` after step ``i + lag``: waits for that copy only then (it has usually finished
  while step ``i + 1`` computed) and frees the device block — no barrier per layer, the
  synchronisation vDNN++ removed; with ``cache`` the block stays resident until memory is
  needed (SuperNeurons' tensor cache);
* ``prefetch`` before step ``max(i + lag + 1, j - lookahead)``: allocate and start the
  host→device copy;
* ``await`` before step ``j``: compute waits only if the copy is not done (stall time).

The release point is fixed by the plan, so the peak is deterministic and a meta dry run
reaches exactly the peak of a real run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..ir.config import SwapPolicy
from ..ir.liveness import lifetimes, root_of
from ..ir.names import Category, Phase, Role
from ..ir.plan import Await, Offload, Plan, Prefetch, Release, StepPlan
from ..ir.program import Program

#: Default bandwidth assumed for transfers before any is measured (bytes/s).
DEFAULT_BANDWIDTH = 4e9


@dataclass(frozen=True)
class SwapCandidate:
    root: int
    last_forward: int
    first_backward: int
    nbytes: int


def swap_candidates(program: Program, aliases: dict[int, int],
                    mode: SwapPolicy | str) -> list[SwapCandidate]:
    """Blocks holding feature maps that backward needs, with their forward/backward use.

    ``mode`` ``conv``: only blocks read by a convolution's forward (vDNN_conv); ``all`` (and
    ``auto``, which filters later): every such block (vDNN_all). A stash kept encoded (see
    :mod:`.compress`) is swapped in its encoded form — fewer bytes over the copy engine, as
    cDMA compresses before the transfer.
    """
    members: dict[int, list[int]] = {}
    for t in lifetimes(program):
        members.setdefault(root_of(aliases, t), []).append(t)
    fwd_last: dict[int, int] = {}
    bwd_first: dict[int, int] = {}
    conv_input: set[int] = set()
    for st in program.steps:
        touched = set(st.access.reads) | set(st.access.writes)
        for t in touched:
            if program.tensors[t].persistent:
                continue
            r = root_of(aliases, t)
            if st.phase in (Phase.FORWARD, Phase.ENCODE):
                fwd_last[r] = st.index
                if st.op.caps.convolution and t in st.access.reads:
                    conv_input.add(r)
            elif st.phase in (Phase.BACKWARD, Phase.RECOMPUTE, Phase.DECODE) \
                    and t in st.access.reads and r not in bwd_first:
                bwd_first[r] = st.index
    for st in program.steps:  # an encoded conv input counts as a conv input
        if st.phase == Phase.ENCODE and root_of(aliases, st.op.codec.source) in conv_input:
            conv_input.add(st.access.writes[0])
    out = []
    for r in members:
        spec = program.tensors[r]
        kept_value = spec.role == Role.VALUE \
            and spec.category in (Category.FEATURE_MAP, Category.INPUT)
        if not (kept_value or spec.role == Role.ENCODED):
            continue
        if r not in fwd_last or r not in bwd_first:
            continue
        if mode == SwapPolicy.CONV and r not in conv_input:
            continue
        out.append(SwapCandidate(r, fwd_last[r], bwd_first[r], spec.nbytes))
    return sorted(out, key=lambda c: c.last_forward)


def hides_transfer(c: SwapCandidate, step_times: list[float], bandwidth: float) -> bool:
    """Capuchin's rule: swap when the idle time between the tensor's forward and backward use
    hides both transfers."""
    idle = sum(step_times[c.last_forward + 1:c.first_backward])
    return idle >= 2.0 * c.nbytes / bandwidth


def hidden_on_one_link(candidates: list[SwapCandidate], step_times: list[float],
                       bandwidth: float) -> list[SwapCandidate]:
    """The candidates whose transfers hide under compute when all of them share the link:
    offloads queue on it in forward order, prefetches in backward order, each copy taking
    ``nbytes / bandwidth``. A candidate is kept when its offload ends, behind the offloads
    already kept, early enough for its prefetch to arrive before its first backward use, and
    that prefetch fits, behind the later ones kept, after its offload (Capuchin's rule with the
    link's queue; ``hides_transfer`` looks at one tensor as if the link were free)."""
    ends = []
    total = 0.0
    for t in step_times:
        total += t
        ends.append(total)

    def done_by(i: int) -> float:  # compute time at the end of step i (0 before step 0)
        return ends[i] if i >= 0 else 0.0

    kept, off_end, link = [], {}, 0.0
    for c in sorted(candidates, key=lambda c: c.last_forward):
        copy = c.nbytes / bandwidth
        end = max(done_by(c.last_forward), link) + copy
        if end + copy <= done_by(c.first_backward - 1):
            kept.append(c)
            off_end[c.root] = end
            link = end
    final, next_start = [], float("inf")
    for c in sorted(kept, key=lambda c: -c.first_backward):
        copy = c.nbytes / bandwidth
        start = min(done_by(c.first_backward - 1), next_start) - copy
        if start >= off_end[c.root]:
            final.append(c)
            next_start = start
    return sorted(final, key=lambda c: c.last_forward)


def _link_schedule(chosen: list[SwapCandidate], step_times: list[float],
                   bandwidth: float) -> dict[int, tuple[float, float]]:
    """When each chosen tensor's offload ends and its prefetch should start, in compute time,
    with the offloads queued on the link in forward order and the prefetches in backward
    order, each as late as its first backward use allows (never before its offload ends)."""
    ends, total = [], 0.0
    for t in step_times:
        total += t
        ends.append(total)

    def done_by(i: int) -> float:
        return ends[i] if i >= 0 else 0.0

    off_end, link = {}, 0.0
    for c in sorted(chosen, key=lambda c: c.last_forward):
        link = off_end[c.root] = max(done_by(c.last_forward), link) + c.nbytes / bandwidth
    out, next_start = {}, float("inf")
    for c in sorted(chosen, key=lambda c: -c.first_backward):
        start = max(off_end[c.root],
                    min(done_by(c.first_backward - 1), next_start) - c.nbytes / bandwidth)
        out[c.root] = (off_end[c.root], start)
        next_start = start
    return out


def _timed(c: SwapCandidate, step_times: list[float], when: tuple[float, float],
           release_at: int, fetch_at: int) -> tuple[int, int]:
    """With step times: release the block once compute has reached the end of its offload
    (vDNN frees a layer's input when its transfer completes, so compute does not wait for it)
    and issue the prefetch at the last step boundary before its planned start — within the
    idle window, release before prefetch."""
    off_end, pre_start = when
    done = sum(step_times[:release_at + 1])
    while done < off_end and release_at + 1 < fetch_at - 1:
        release_at += 1
        done += step_times[release_at]
    issued = sum(step_times[:fetch_at])  # compute done when issued before step fetch_at
    while issued > pre_start and fetch_at - 1 > release_at:
        fetch_at -= 1
        issued -= step_times[fetch_at]
    return release_at, fetch_at


def timed_steps(last_forward: int, first_backward: int, transfer: float,
                step_times: list[float], lag: int = 1, lookahead: int = 2) -> tuple[int, int]:
    """(release step, prefetch step) :func:`swap_plan` gives one swapped block with
    ``step_times`` when its copies (``transfer`` each way, in the units of ``step_times``) have
    the link to themselves: the placement the optimal planner's model assumes."""
    c = SwapCandidate(-1, last_forward, first_backward, transfer)  # bytes at bandwidth 1: time
    release_at = last_forward + lag
    return _timed(c, step_times, _link_schedule([c], step_times, 1.0)[c.root], release_at,
                  max(release_at + 1, first_backward - lookahead))


def swap_plan(plan: Plan, mode: SwapPolicy | str, lookahead: int = 2, lag: int = 1,
              step_times: list[float] | None = None,
              bandwidth: float = DEFAULT_BANDWIDTH, only: set[int] | None = None,
              cost_source: str = "measured step times", force: frozenset[int] = frozenset(),
              exclude: frozenset[int] = frozenset()) -> Plan:
    """``plan`` with offload / release / prefetch / await actions inserted (a new plan).

    ``only`` restricts swapping to the blocks holding these tensors (the auto planner's
    choice); ``mode`` then only names the candidates considered. ``cost_source`` says in the
    note where ``step_times`` came from. Blocks (roots) in ``force`` are swapped whatever the
    mode and ``only`` say, those in ``exclude`` never (the network's block choices,
    :mod:`.block_choices`)."""
    program = plan.program
    chosen, forced = [], []
    measured = step_times is not None and len(step_times) == len(program.steps) \
        and sum(step_times) > 0
    auto = mode == SwapPolicy.AUTO
    base_mode = SwapPolicy.CONV if auto and not measured else mode
    for c in swap_candidates(program, plan.aliases,
                             SwapPolicy.ALL if base_mode == SwapPolicy.AUTO else base_mode):
        if c.first_backward - c.last_forward < lag + 2 or c.root in exclude:
            continue  # no idle time to hide anything, or kept by the user
        if c.root in force:
            forced.append(c)
            continue
        if base_mode == SwapPolicy.AUTO and not hides_transfer(c, step_times, bandwidth):
            continue
        if only is not None and c.root not in only:
            continue
        chosen.append(c)
    if base_mode == SwapPolicy.AUTO:  # all of them share one link
        chosen = hidden_on_one_link(chosen, step_times, bandwidth)
    chosen = sorted(chosen + forced, key=lambda c: c.last_forward)
    before = [list(sp.before) for sp in plan.steps]
    after = [list(sp.after) for sp in plan.steps]
    schedule = _link_schedule(chosen, step_times, bandwidth) if measured else {}
    for c in chosen:
        release_at = c.last_forward + lag
        fetch_at = max(release_at + 1, c.first_backward - lookahead)
        if measured:
            release_at, fetch_at = _timed(c, step_times, schedule[c.root], release_at, fetch_at)
        after[c.last_forward].append(Offload(c.root))
        after[release_at].append(Release(c.root))
        before[fetch_at].append(Prefetch(c.root))
        before[c.first_backward].append(Await(c.root))
    swapped = sum(c.nbytes for c in chosen)
    how = cost_source if measured else (
        "no measurement yet: behaving as swap=conv" if auto else f"swap={mode}")
    note = (f"swap: {len(chosen)} feature maps offloaded ({swapped:,} B per iteration), "
            f"prefetch lookahead {lookahead} steps ({how})")
    return replace(plan, steps=tuple(StepPlan(b, a) for b, a in zip(before, after)),
                   notes=(*plan.notes, note),
                   swapping=replace(plan.swapping, blocks=tuple(c.root for c in chosen)))
