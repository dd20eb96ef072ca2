"""ZeRO's sharded training state (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", 2020): what one data-parallel rank keeps.

The trainable parameters, each flattened and concatenated in program order (``T`` elements),
are cut into ``ranks`` contiguous ranges of ``S = ceil(T / ranks)`` elements; rank ``r`` owns
``[r S, (r + 1) S)`` (:func:`owned_ranges`). Stage 1 keeps only the owned ranges of the
optimizer state, stage 2 also of the gradients, stage 3 also of the parameters (buffers such as
BatchNorm's running statistics are never sharded). Every owned range of a tensor is its own
block in the pool, rounded to the program's allocation unit, as the engine allocates it.

From stage 2 on, no rank keeps a parameter's full gradient between iterations: the program is
lowered with the full gradients as tensors of the iteration (written by backward, copied into
their bucket, freed after their last write), so their bytes count in the iteration's peak, not
in the persistent state. Stage 3 likewise lowers every step's trainable parameters as blocks
of the iteration, gathered whole just before the step and freed after their last use.

:func:`zero_bytes` reads a program lowered without sharding (or lowered for stage 2 or 3 with
no shards in it: full gradients, parameters, as tensors of the iteration) and gives one rank's
persistent bytes by category and the collectives of one step with the bytes each moves;
``saved_bytes`` is what to take off that program's peak (run with its own persistent state)
to get the rank's. A program lowered for ``offload=optimizer`` (no ZeRO; the gradients tensors
of the iteration, copied to the host) keeps its own persistent bytes on every rank, at every
stage (``offload=True``): the gradients are summed on the host, and the sharded state (master
weights, optimizer state) lives there too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..ir.names import Role
from ..ir.program import Program

#: Stages and what each shards (cumulative, as in the paper).
STAGES = {1: "optimizer state", 2: "optimizer state and gradients",
          3: "optimizer state, gradients and parameters"}


def owned_ranges(sizes: Sequence[int], ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """``(tensor index, lo, hi)``: the flat element ranges of tensors of ``sizes`` (in order)
    that ``rank`` of ``ranks`` owns; empty ranges are left out."""
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not a rank of {ranks}")
    shard = -(-sum(sizes) // ranks)
    start, stop = rank * shard, (rank + 1) * shard
    out, base = [], 0
    for i, n in enumerate(sizes):
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            out.append((i, lo - base, hi - base))
        base += n
    return out


@dataclass(frozen=True)
class Collective:
    """One collective of a step: its name, the buffer it works on (payload bytes) and the bytes
    each rank sends with the ring algorithm."""

    name: str
    payload_bytes: int
    sent_bytes: int


@dataclass(frozen=True)
class ZeroBytes:
    """One rank's persistent bytes by category under ``stage`` (0: no sharding), the same
    without sharding, and the step's collectives."""

    stage: int
    ranks: int
    rank: int
    persistent: dict[str, int]
    unsharded: dict[str, int]
    collectives: tuple[Collective, ...]
    #: Stage 3: the largest layer's parameters, gathered whole just before use (blocks the
    #: unsharded iteration does not have); 0 otherwise.
    gather_bytes: int = 0
    #: The persistent bytes of the program read (its full gradients left out when it was
    #: lowered with them as tensors of the iteration); default: ``unsharded``'s total.
    program_bytes: int = -1
    #: Whether the program read was lowered for stage 3 (every step's parameters gathered
    #: into blocks of its own): its iteration peak then holds the gathered blocks already.
    gathered_in_program: bool = False
    #: Whether the program was lowered for offload=optimizer: the rank's shards (master
    #: weights, optimizer state, stage 2's gradients) are on its host, not in these bytes.
    offloaded: bool = False

    @property
    def saved_bytes(self) -> int:
        """Bytes this rank holds less at its peak than the program read, run with its own
        persistent state (persistent bytes saved, less the stage-3 gather block where the
        program does not gather itself)."""
        base = sum(self.unsharded.values()) if self.program_bytes < 0 else self.program_bytes
        gather = 0 if self.gathered_in_program else self.gather_bytes
        return base - sum(self.persistent.values()) - gather


def zero_bytes(program: Program, stage: int, ranks: int, rank: int = 0,
               offload: bool = False) -> ZeroBytes:
    """One rank's persistent bytes under ZeRO ``stage`` (0-3) over ``ranks`` ranks, from
    ``program`` lowered for training without sharding (``offload``: for offload=optimizer,
    whose sharded state is on the host; see the module docstring)."""
    if stage not in (0, *STAGES):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    persistent = [t for t in program.tensors if t.persistent]
    if any(t.role == Role.GRAD_SHARD for t in persistent):
        raise ValueError("zero_bytes reads a program lowered without sharding; this one holds "
                         "gradient shards")
    grads = {t.name: t for t in program.tensors if t.role == Role.PARAM_GRAD}
    # the trainable parameters, by their gradients (same shapes and order; a program lowered
    # for stage 3 has no persistent tensor of them, only blocks gathered per step)
    trainable = list(grads.values())
    gathered = any(t.role == Role.PARAM and not t.persistent for t in program.tensors)
    sizes = [math.prod(t.shape) for t in trainable]
    owned = owned_ranges(sizes, ranks, rank)

    def sharded(itemsizes: list[int]) -> int:
        return sum(program.block_size((hi - lo) * itemsizes[i]) for i, lo, hi in owned)

    def full(tensors) -> int:
        return sum(program.block_size(t.nbytes) for t in tensors)

    items = [t.nbytes // max(n, 1) for t, n in zip(trainable, sizes)]
    state = [t for t in persistent if t.role == Role.OPT_STATE]
    slots = len(state) // max(len(trainable), 1)
    buffers = [t for t in persistent if t.role == Role.PARAM and t.name + ".grad" not in grads]
    unsharded = {"parameter": full(trainable) + full(buffers),
                 "gradient": full(grads.values()), "optimizer_state": full(state)}
    offloaded = (stage == 0 or offload) and trainable and \
        not any(t.persistent for t in trainable)
    if offloaded:
        # offload=optimizer: gradients, optimizer state and master weights on the host; the
        # device holds the program's persistent tensors (parameters, in mixed precision some
        # only as half copies) and the gradients as tensors of the iteration
        unsharded = {"parameter": full(t for t in persistent if t.role != Role.OPT_STATE),
                     "gradient": 0, "optimizer_state": full(state)}
    mine = dict(unsharded)
    if not offloaded:  # (offloaded: the device's bytes; the shards are the host's)
        if stage >= 1:
            mine["optimizer_state"] = slots * sharded(items)
        if stage >= 2:
            mine["gradient"] = sharded(items)
        if stage >= 3:
            mine["parameter"] = sharded(items) + full(buffers)
    flat = -(-sum(sizes) // ranks) * ranks * (items[0] if items else 4)
    share = flat * (ranks - 1) // ranks
    if stage <= 1:
        colls = [Collective("all-reduce gradients", flat, 2 * share)]
    else:
        colls = [Collective("reduce-scatter gradients", flat, share)]
    if stage in (1, 2):
        colls.append(Collective("all-gather parameters", flat, share))
    if stage == 3:
        colls += [Collective("all-gather parameters (forward)", flat, share),
                  Collective("all-gather parameters (backward)", flat, share),
                  Collective("all-gather parameters (host copy)", flat, share)]
    layers: dict[str, int] = {}
    for t in trainable:
        layers[t.layer] = layers.get(t.layer, 0) + program.block_size(t.nbytes)
    gather = max(layers.values(), default=0) if stage == 3 else 0
    return ZeroBytes(stage, ranks, rank, mine, unsharded, tuple(colls), gather,
                     sum(program.block_size(t.nbytes) for t in persistent), gathered,
                     bool(offloaded))
