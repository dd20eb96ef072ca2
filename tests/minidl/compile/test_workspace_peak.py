"""Convolution workspaces chosen for memory without a budget (vDNN's rule,
memory/options/workspace_options.py) and vDNN's policy on a target's memory, through the engine: the
peak of the least-workspace plan, the same caps and bits for every lossless spec, dry-run peak
== real peak, and ``vdnn`` taking memory-optimal workspaces where that is what fits."""

from __future__ import annotations

import re

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.compile.engine import Engine
from minidl.compile.lowering import lower
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.options import workspace_caps as WC
from minidl.memory.options import workspace_options as W
from minidl.memory.passes.base_plan import plan_peak
from minidl.memory.planners.planner import make_plan
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import SGD

SHAPE = (8, 16, 16)
BATCH = 8


@pytest.fixture(autouse=True)
def _rule_on_cpu(monkeypatch):
    """vDNN's rule for the cpu kind (off by default: see W.RULE_KINDS)."""
    monkeypatch.setattr(W, "RULE_KINDS", ("cpu",))


def _net():
    """Wide convolutions on small planes: their fastest workspaces dominate the peak."""
    return minidl.Sequential([
        L.Conv2d(8, 64, 3, padding=1), L.ReLU(),
        L.Conv2d(64, 128, 3, padding=1), L.ReLU(), L.MaxPool2d(2),
        L.Conv2d(128, 128, 3, padding=1), L.ReLU(), L.GlobalAvgPool2d(), L.Linear(128, 10),
    ], input_shape=SHAPE)


def _compiled(spec, rule=True, share=float("inf")):
    net = _net()
    eng = Engine(net, Pool(MetaDevice()), spec, SoftmaxCrossEntropy(),
                 SGD(net.parameters(), lr=0.1, momentum=0.9), bind=False)
    eng.cap_workspaces, eng.workspace_time_share = rule, share
    return eng.compiled([(BATCH, *SHAPE)], (BATCH,), True)


def _caps(c):
    return {st.layer: st.op.options[WC.OPTION] for st in c.plan.program.steps
            if st.op.options.get(WC.OPTION) is not None}


def _data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((BATCH, *SHAPE)).astype(np.float32),
            rng.integers(0, 10, BATCH))


def _train(spec, share=float("inf"), steps=2, **kwargs):
    net = _net()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device_memory="256MiB", debug=True, **kwargs)
    tr.engine.workspace_time_share = share
    x, y = _data()
    losses = [tr.step(x, y) for _ in range(steps)]
    return losses, {n: np.array(p.data) for n, p in net.named_parameters()}, tr


def _lean_peak():
    """The peak of the canonical spec's plan with every convolution at its least workspace."""
    net = _net()
    eng = Engine(net, Pool(MetaDevice()), "reuse,inplace", SoftmaxCrossEntropy(),
                 SGD(net.parameters(), lr=0.1, momentum=0.9), bind=False)
    eng.cap_workspaces = False
    program = eng.compiled([(BATCH, *SHAPE)], (BATCH,), True).lowered.program
    low = lower(net, [(BATCH, *SHAPE)], loss=eng.loss, label_shape=(BATCH,),
                label_dtype="int64", training=True, opt_state=eng.opt_state_specs,
                alignment=eng.pool.alignment, options=W.lean_options(program),
                device_kind="cpu")
    return plan_peak(make_plan(low.program, W.CANONICAL))


def test_without_a_budget_the_peak_is_the_least_workspace_peak():
    rule, fast = _compiled("reuse,inplace"), _compiled("reuse,inplace", rule=False)
    assert _caps(rule) and not _caps(fast)
    note = [n for n in rule.plan.notes if n.startswith(W.NOTE_PREFIX)]
    assert len(note) == 1 and W.AT_PEAK in note[0]
    assert plan_peak(rule.plan) == _lean_peak() < plan_peak(fast.plan)
    # the default: vDNN's rule as it stands
    assert _caps(_compiled("reuse,inplace", share=W.TIME_SHARE)) == _caps(rule)
    # some of the peak traded back for time: between the two, never above the fastest
    # configurations' peak
    traded = _compiled("reuse,inplace", share=0.02)
    assert plan_peak(rule.plan) <= plan_peak(traded.plan) <= plan_peak(fast.plan)


def test_every_lossless_spec_runs_the_rules_caps_bit_identically_and_exactly():
    caps = _caps(_compiled("reuse,inplace"))
    assert caps
    base = _train("none")
    for spec in ("reuse,inplace", "reuse,swap=all", "reuse,recompute=sqrt,static", "vdnn"):
        assert _caps(_compiled(spec)) == caps, spec
        losses, params, tr = _train(spec)
        assert losses == base[0], spec
        for n, p in base[1].items():
            assert np.array_equal(params[n], p), (spec, n)
        rep = minidl.dry_run(_net(), BATCH, spec)  # (default share: not forced here)
        tr_default = _train(spec, share=W.TIME_SHARE)[2]
        assert tr_default.memory_report()["peak_allocated_bytes"] == \
            rep["peak_allocated_bytes"], spec
        assert tr_default.memory_report()["peak_reserved_bytes"] == \
            rep["peak_reserved_bytes"], spec


CUSTOM = "custom:flops=15T,hbm=900G,link=12G,mem={mem}"


def test_vdnn_takes_memory_optimal_workspaces_where_that_is_what_fits():
    roomy = minidl.dry_run(_net(), BATCH, "vdnn", target=CUSTOM.format(mem="16GiB"))
    assert not any("vDNN's policy" in n or WC.FIT_BUDGET in n for n in roomy["notes"])
    tiny = minidl.dry_run(_net(), BATCH, "vdnn", target=CUSTOM.format(mem="1KiB"))
    note = next(n for n in tiny["notes"] if n.startswith("vDNN's policy: does not fit"))
    least = int(re.search(r"least workspaces \(([\d,]+) B\)", note).group(1).replace(",", ""))
    assert least < roomy["peak_reserved_bytes"]
    rep = minidl.dry_run(_net(), BATCH, "vdnn", target=CUSTOM.format(mem=least))
    assert rep["peak_reserved_bytes"] <= least < roomy["peak_reserved_bytes"]
    assert any("vDNN's policy: each prefetch" in n for n in rep["notes"])
    assert any(n.startswith(W.NOTE_PREFIX) and WC.FIT_BUDGET in n for n in rep["notes"])
    # the run a CPU makes of that plan (the target's link emulated): the dry run's peak
    target = CUSTOM.format(mem=least)
    emu = minidl.dry_run(_net(), BATCH, "vdnn", target=target, emulated=True)
    _, _, tr = _train("vdnn", share=W.TIME_SHARE, emulate_link=target)
    real = tr.memory_report()
    assert real["peak_reserved_bytes"] == emu["peak_reserved_bytes"] <= least
    assert real["peak_allocated_bytes"] == emu["peak_allocated_bytes"]
