"""One allocation unit, from the pool to every planner.

A pool made with another alignment than the default must get plans made for its unit: static
offsets it can place, and dry-run, planned and real peaks that agree for that unit.
"""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.memory import Pool
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.program import Program, TensorSpec
from minidl.memory.ir.units import ALLOCATION_UNIT, aligned
from minidl.zoo.models import smallcnn

SHAPE = (1, 12, 12)
BATCH = 6


def _net():
    return smallcnn(SHAPE, 10, width=4)


def _real_peaks(spec: str, alignment: int) -> tuple[dict, object]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *SHAPE)).astype(np.float32)
    y = rng.integers(0, 10, BATCH)
    tr = minidl.Trainer(_net(), memory=spec, device_memory="32MiB", alignment=alignment)
    tr.step(x, y)
    return tr.pool.stats(), tr


def test_one_definition_of_the_unit():
    assert Pool(MetaDevice()).alignment == ALLOCATION_UNIT
    assert Program([], [], []).alignment == ALLOCATION_UNIT
    assert aligned(1) == ALLOCATION_UNIT and aligned(0, 4096) == 4096
    assert aligned(4097, 4096) == 8192


@pytest.mark.parametrize("spec", ["reuse,inplace", "reuse,inplace,static", "reuse,static,swap=all",
                                  "reuse,recompute=sqrt,static"])
@pytest.mark.parametrize("alignment", [1024, 4096])
def test_dry_run_and_plans_exact_for_the_pool_unit(spec, alignment):
    rep = minidl.dry_run(_net(), BATCH, spec, input_shape=SHAPE, alignment=alignment)
    stats, tr = _real_peaks(spec, alignment)
    assert rep["peak_allocated_bytes"] == stats["allocated_bytes.peak"]
    assert rep["peak_reserved_bytes"] == stats["reserved_bytes.peak"]
    assert rep["persistent_bytes"] % alignment == 0
    c = tr.engine.compiled([(BATCH, *SHAPE)], (BATCH,), True)
    assert c.plan.program.alignment == alignment
    if "static" in spec:  # the planned arena is what the pool reserved
        assert stats["reserved_bytes.peak"] == c.plan.static.base + c.plan.static.arena
    default = minidl.dry_run(_net(), BATCH, spec, input_shape=SHAPE)
    assert default["peak_allocated_bytes"] != rep["peak_allocated_bytes"]


def test_program_rounds_with_its_own_unit():
    t = [TensorSpec(0, "w", (10,), "float32", "parameter", "param", persistent=True),
         TensorSpec(1, "x", (300,), "float32", "feature_map", "value")]
    assert Program(t, [], [0]).persistent_bytes() == 512
    assert Program(t, [], [0], alignment=4096).persistent_bytes() == 4096
    assert Program(t, [], [0], alignment=64).persistent_bytes() == 64


def test_a_plan_for_another_unit_is_refused():
    from minidl.memory.ir.plan import Plan
    from minidl.memory.runtime.runtime import MemoryRuntime

    prog = Program([], [], [], alignment=4096)
    with pytest.raises(ValueError, match="4096-byte blocks"):
        MemoryRuntime(Pool(MetaDevice()), prog, Plan(prog, []))
