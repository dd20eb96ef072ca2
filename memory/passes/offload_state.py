"""Persistent state on the host (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model
Training", 2021): the optimizer state and master weights live in host memory and the update
runs on the host cores, so the device keeps only the parameters and the iteration.

The program is lowered with the parameters' gradients as tensors of the iteration (as under
ZeRO stage 2) and without optimizer state. This pass makes each gradient leave the device as
backward writes it, with the actions swapping uses (:mod:`.swap`): gradients are gathered in
buckets in the order backward finishes them; when a bucket holds ``bucket_bytes`` (or backward
writes no more gradients) an ``Offload`` of each of its gradients is issued after the step that
closed it, so the copies run on the device-to-host engine while the next step computes, and a
``Release`` after that next step frees their blocks (compute waits there for any copy still
running). The host copy is the gradient the update reads: each gradient is ``Free``d at the
end of the iteration, from the host. The cost model prices the copies on the target's link
like any offload; :class:`~minidl.compile.host_state.HostState` says what the host holds.
Under ZeRO stage 2 (``sharded``) no copy is planned: as ZeRO stage 2 does on the device, data
parallelism's buckets take each gradient at its last write, the ranks reduce-scatter them and
each host receives only its owned range's sums; the plan only says so.
In mixed precision the program's half parameter tensors are the device's only copies of
those parameters (ZeRO-Offload's fp16 parameters; the note counts them).
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.names import Role
from ..ir.plan import Free, Offload, Plan, Release, StepPlan
from ..ir.precision import itemsize
from ..ir.program import Program

#: Bytes of gradients copied together (a bucket): the copies of a bucket start after the step
#: that fills it (PyTorch DDP's default bucket is 25 MiB; smaller keeps fewer gradients waiting
#: on the device).
DEFAULT_BUCKET_BYTES = 4 << 20


def offloaded_gradients(program: Program) -> list[int]:
    """The gradients that leave the device: parameter gradients lowered as tensors of the
    iteration, in id order."""
    return [t.id for t in program.tensors if t.role == Role.PARAM_GRAD and not t.persistent]


def offload_state_plan(plan: Plan, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       sharded: bool = False) -> Plan:
    """``plan`` with every offloaded gradient (:func:`offloaded_gradients`) copied to the host
    in buckets as backward writes it (``sharded``: ZeRO stage 2, no copies; see the module
    docstring); a new plan."""
    program = plan.program
    grads = set(offloaded_gradients(program))
    if not grads:
        return plan
    if sharded:
        sizes = program.block_sizes
        note = (f"offload=optimizer,zero=2: each rank's shard of the optimizer state and "
                f"master weights on its host, the update there; {len(grads)} gradients "
                f"({_mib(sum(sizes[t] for t in grads))}) reduce-scattered from data "
                "parallelism's buckets, each host receiving its owned range's sums")
        return replace(plan, notes=(*plan.notes, note + _half_note(program)))
    aliased = grads & (set(plan.aliases) | set(plan.aliases.values()))
    if aliased:
        name = program.tensors[min(aliased)].name
        raise ValueError(f"offload: gradient {name} shares a block; it cannot leave the "
                         "device alone")
    n = len(plan.steps)
    before = [list(sp.before) for sp in plan.steps]
    after = [list(sp.after) for sp in plan.steps]
    end = list(plan.end)
    freed_at: dict[int, int] = {}  # gradient -> the step whose ``after`` freed it
    for i in range(n):
        kept = []
        for a in after[i]:
            if isinstance(a, Free) and a.tensor in grads:
                freed_at[a.tensor] = i
            else:
                kept.append(a)
        after[i] = kept
    missing = grads - set(freed_at)
    if missing:
        name = program.tensors[min(missing)].name
        raise ValueError(f"offload: gradient {name} is not freed after a step of the plan")
    sizes = program.block_sizes
    buckets: list[tuple[int, list[int]]] = []  # (closing step, gradients)
    open_bucket: list[int] = []
    filled = 0
    order = sorted(freed_at, key=lambda t: (freed_at[t], t))
    for k, t in enumerate(order):
        open_bucket.append(t)
        filled += sizes[t]
        if k == len(order) - 1 or filled >= bucket_bytes and freed_at[order[k + 1]] != \
                freed_at[t]:
            buckets.append((freed_at[t], open_bucket))
            open_bucket, filled = [], 0
    releases_at_end: list[int] = []
    for closing, members in buckets:
        after[closing] += [Offload(t) for t in members]
        if closing + 1 < n:
            after[closing + 1] += [Release(t) for t in members]
        else:
            releases_at_end += members
    end = [*(Release(t) for t in releases_at_end), *(Free(t) for t in order), *end]
    steps = tuple(StepPlan(b, a) for b, a in zip(before, after))
    note = (f"offload=optimizer: optimizer state and master weights on the host, the update "
            f"there; {len(order)} gradients ({_mib(sum(sizes[t] for t in order))}) copied to "
            f"the host in {len(buckets)} buckets of >= {_mib(bucket_bytes)} as backward writes "
            "them, each bucket's copies overlapping the next step")
    return replace(plan, steps=steps, end=tuple(end),
                   notes=(*plan.notes, note + _half_note(program)))


def _half_note(program: Program) -> str:
    """The note's part on the parameters the device keeps only as half copies."""
    sizes = program.block_sizes
    half = [t for t in program.tensors if t.role == Role.PARAM and t.persistent
            and itemsize(str(t.dtype)) == 2]
    if not half:
        return ""
    return (f"; {len(half)} parameters ({_mib(sum(sizes[t.id] for t in half))}) on the "
            f"device only as their {half[0].dtype} copies, rounded from the host's "
            "float32 master after each update")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"

