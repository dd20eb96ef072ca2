"""The residency state machine: every state x every action, and the runtime driving it."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.memory.devices.device import CpuDevice
from minidl.memory.ir.plan import (
    Alloc,
    Await,
    Free,
    Offload,
    Plan,
    Prefetch,
    Release,
    Swapping,
)
from minidl.memory.ir.program import Program, TensorSpec
from minidl.memory.ir.residency import (
    ACTIONS,
    TRANSITIONS,
    IllegalTransition,
    Residency,
    SwapState,
    TensorRecord,
)
from minidl.memory.runtime.host_pool import HostPool
from minidl.memory.runtime.pool import Pool
from minidl.memory.runtime.runtime import MemoryRuntime, TensorNotResident

R = Residency
HOLDING = (R.ON_DEVICE, R.OFFLOADING, R.ON_HOST, R.PREFETCHING, R.CACHED)
#: The documented machine, written out independently of the module's table.
EXPECTED = {
    "allocate": {R.UNALLOCATED: R.ON_DEVICE, R.FREED: R.ON_DEVICE},
    "reallocate": {R.ON_DEVICE: R.ON_DEVICE},
    "offload": {R.ON_DEVICE: R.OFFLOADING},
    "release": {R.OFFLOADING: R.ON_HOST},
    "keep_cached": {R.OFFLOADING: R.CACHED},
    "evict": {R.CACHED: R.ON_HOST},
    "reuse_cached": {R.CACHED: R.PREFETCHING},
    "prefetch": {R.ON_HOST: R.PREFETCHING},
    "await_prefetch": {R.PREFETCHING: R.ON_DEVICE},
    "free": {s: R.FREED for s in HOLDING},
}


class _Block:
    size = 512

    def view(self, shape, dtype):
        return np.zeros(shape, dtype)


#: Arguments of each transition method (resources the new state owns).
ARGS = {"allocate": (_Block(), "view"), "reallocate": (_Block(), "view"),
        "offload": ("host", "d2h"), "prefetch": (_Block(), "h2d"),
        "await_prefetch": ("view",)}


def test_the_table_is_the_documented_machine():
    assert set(ACTIONS) == set(EXPECTED)
    assert TRANSITIONS == {(s, a): t for a, moves in EXPECTED.items() for s, t in moves.items()}


@pytest.mark.parametrize("action", sorted(EXPECTED))
@pytest.mark.parametrize("state", list(Residency), ids=lambda s: s.value)
def test_every_state_and_action(state, action):
    rec = TensorRecord(7, "conv1", state, block=_Block(), swap=SwapState(host="host"))
    move = getattr(rec, action)
    if state in EXPECTED[action]:
        move(*ARGS.get(action, ()))
        assert rec.state is EXPECTED[action][state]
    else:
        with pytest.raises(IllegalTransition) as e:
            move(*ARGS.get(action, ()))
        assert rec.state is state  # nothing changed
        assert (e.value.name, e.value.state, e.value.action) == ("conv1", state, action)
        assert "conv1" in str(e.value) and state.value in str(e.value) and action in str(e.value)


def test_what_each_state_owns():
    rec = TensorRecord(0, "t")
    blk = _Block()
    rec.allocate(blk, "v")
    assert (rec.block, rec.view) == (blk, "v")
    rec.offload("host", "d2h")
    assert (rec.view, rec.swap.host, rec.swap.d2h, rec.swap.nbytes) == (None, "host", "d2h", 512)
    rec.release()
    assert rec.block is None and rec.swap.host == "host"
    rec.prefetch(blk, "h2d")
    assert (rec.block, rec.swap.h2d) == (blk, "h2d")
    rec.await_prefetch("v2")
    assert (rec.view, rec.swap.host) == ("v2", None)
    rec.free()
    assert (rec.block, rec.view, rec.swap.host, rec.swap.d2h, rec.swap.h2d) == (None,) * 5


# ---------------------------------------------------------------- the runtime drives records
def _runtime(units: list[int], aliases: dict[int, int] | None = None, cache: bool = False,
             capacity: str = "64KiB") -> MemoryRuntime:
    tensors = [TensorSpec(i, f"t{i}", (u * 128,), "float32", "feature_map", "value")
               for i, u in enumerate(units)]
    program = Program(tensors=tensors, steps=[], inputs=[])
    device = CpuDevice(capacity)
    plan = Plan(program, steps=(), aliases=aliases or {}, swapping=Swapping(cache=cache))
    return MemoryRuntime(Pool(device), program, plan, HostPool(device))


def test_a_swap_round_trip_moves_through_the_states_and_keeps_the_values():
    rt = _runtime([2, 1], aliases={1: 0})
    rt.apply(Alloc(0))
    rt.apply(Alloc(1))  # a view of t0's block
    rt.array(0)[:] = np.arange(256)
    rt.apply(Offload(0))
    assert rt.residency(0) is R.OFFLOADING and rt.residency(1) is R.OFFLOADING
    with pytest.raises(TensorNotResident, match="t1 .* swapped out"):
        rt.array(1)
    rt.apply(Release(0))
    assert rt.residency(0) is R.ON_HOST and rt.pool.allocated_bytes == 0
    rt.apply(Prefetch(0))
    assert rt.residency(0) is R.PREFETCHING
    with pytest.raises(TensorNotResident, match="swapped out"):
        rt.array(0)
    rt.apply(Await(0))
    assert rt.residency(0) is R.ON_DEVICE
    np.testing.assert_array_equal(rt.array(0), np.arange(256))
    np.testing.assert_array_equal(rt.array(1), np.arange(128))
    assert rt.host_pool.in_use_bytes == 0
    rt.apply(Free(1))
    rt.apply(Free(0))
    assert rt.residency(0) is R.FREED and rt.pool.allocated_bytes == 0
    stats = rt.swap_stats
    assert (stats.offloaded_bytes, stats.prefetched_bytes) == (1024, 1024)


@pytest.mark.parametrize("actions, bad", [
    ([Release(0)], "tensor t0 is unallocated: cannot release"),
    ([Alloc(0), Release(0)], "t0 is on_device: cannot release"),
    ([Alloc(0), Offload(0), Offload(0)], "t0 is offloading: cannot offload"),
    ([Alloc(0), Offload(0), Prefetch(0)], "t0 is offloading: cannot prefetch"),
    ([Alloc(0), Await(0)], "t0 is on_device: cannot await_prefetch"),
    ([Alloc(0), Alloc(0)], "t0 is on_device: cannot allocate"),
    ([Alloc(0), Offload(0), Release(0), Await(0)], "t0 is on_host: cannot await_prefetch"),
])
def test_illegal_plan_actions_raise_before_touching_the_pool(actions, bad):
    rt = _runtime([2])
    *ok, last = actions
    for a in ok:
        rt.apply(a)
    used = (rt.pool.allocated_bytes, rt.host_pool.in_use_bytes)
    with pytest.raises(IllegalTransition, match=bad):
        rt.apply(last)
    assert (rt.pool.allocated_bytes, rt.host_pool.in_use_bytes) == used


def test_freeing_what_is_not_allocated_says_so():
    rt = _runtime([1])
    with pytest.raises(TensorNotResident, match="free of t0: not allocated"):
        rt.apply(Free(0))
    rt.apply(Alloc(0))
    rt.apply(Free(0))
    with pytest.raises(TensorNotResident, match="free of t0: not allocated"):
        rt.apply(Free(0))


def test_an_alias_allocated_while_its_root_is_away_gets_its_view_back_with_it():
    rt = _runtime([2, 2], aliases={1: 0})
    rt.apply(Alloc(0))
    rt.array(0)[:] = 3.0
    rt.apply(Offload(0))
    rt.apply(Release(0))
    rt.apply(Alloc(1))
    assert rt.residency(1) is R.ON_HOST
    rt.apply(Prefetch(0))
    rt.apply(Await(0))
    assert rt.residency(1) is R.ON_DEVICE
    np.testing.assert_array_equal(rt.array(1), np.full(256, 3.0, np.float32))


def test_peak_lists_blocks_in_the_order_they_were_last_assigned():
    rt = _runtime([1, 1, 1])
    for a in (Alloc(0), Alloc(1), Offload(0), Release(0), Alloc(2), Prefetch(0)):
        rt.apply(a)
    rt.peak.snapshot(rt.records)
    assert rt.peak.live == [1, 2, 0]
    rt.note_kept_for_backward()  # t0 is still being prefetched: not counted as kept
    assert rt.kept_for_backward == {"feature_map": 1024}


def test_release_all_returns_every_block_and_host_buffer():
    rt = _runtime([1, 1, 1], cache=True)
    for a in (Alloc(0), Alloc(1), Alloc(2), Offload(0), Release(0), Offload(1)):
        rt.apply(a)
    rt.release_all()
    assert rt.pool.allocated_bytes == 0 and rt.host_pool.in_use_bytes == 0
    assert rt.records == {} and len(rt.cache) == 0
