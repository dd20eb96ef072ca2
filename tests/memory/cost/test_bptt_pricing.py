"""Issue 45: a fused RNN's BPTT schedule is priced by the forward work it does again.

The backward step of a scheduled RNN carries the FLOPs its schedule recomputes
(``Step.cost.recompute_flops``, from the layer's ``recompute_flops``): the cost model adds them to
the step's time, reports them as recomputation, and leaves them out of the unlimited-memory
oracle. So keeping fewer states costs time, and an RNN's curve is no longer one flat point.
"""

from __future__ import annotations

import pytest

import minidl
from minidl.zoo.models import get_model


def _plan(spec: str, seq: int = 64, batch: int = 8) -> dict:
    net = get_model("char-lstm", input_shape=(seq,))
    return minidl.dry_run(net, batch, spec, input_shape=(seq,), target="v100")


def test_bptt_recomputation_costs_time_and_is_reported():
    keep, lean = _plan("reuse,inplace"), _plan("reuse,inplace,bptt=1")
    pk, pl = keep["prediction"], lean["prediction"]
    assert lean["peak_allocated_bytes"] < keep["peak_allocated_bytes"]
    assert pk["recompute_s"] == 0.0
    assert pl["recompute_s"] > 0.0
    # the oracle is the unlimited-memory device's: about the same with or without it
    assert pl["oracle_s"] == pytest.approx(pk["oracle_s"], rel=0.02)  # (its steps touch less)
    # and the step costs the oracle plus what is recomputed (no copies, no codecs here)
    assert pl["step_s"] == pytest.approx(pl["oracle_s"] + pl["recompute_s"], rel=1e-9)
    assert pl["step_s"] > pk["step_s"]
    flops = sum(b["recomputed_flops"] for b in lean["bptt"])
    assert flops > 0


def test_more_states_kept_cost_less():
    times = [_plan(f"reuse,inplace,bptt={k}")["prediction"]["step_s"] for k in (1, 2, 4)]
    assert times[0] >= times[1] >= times[2]
    assert times[0] > times[2]
