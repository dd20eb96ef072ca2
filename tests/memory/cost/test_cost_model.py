"""Device profiles and the cost model: roofline step times and the simulated iteration."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

import minidl
from minidl.memory.cost.cost_model import simulate, step_costs, step_time
from minidl.memory.cost.targets import PROFILES, get_target
from minidl.memory.devices.device import MetaDevice
from minidl.memory.runtime.pool import Pool
from minidl.zoo.models import smallcnn
from tests.least_peak import least_reached


def test_profiles_and_aliases():
    assert get_target("V100") is PROFILES["v100"]
    assert get_target("a100").capacity_bytes == 40 << 30
    assert get_target("titanx").name == "titanx-maxwell"
    for p in PROFILES.values():
        assert p.flops_per_s > 1e12 and p.hbm_bytes_per_s > 1e11 and p.capacity_bytes > 1 << 30
        assert 1e9 < p.link_h2d_bytes_per_s < p.hbm_bytes_per_s


def test_custom_profile():
    p = get_target("custom:flops=10T,hbm=500G,link=8G,mem=8GiB,d2h=6G,launch=1e-5")
    assert (p.flops_per_s, p.hbm_bytes_per_s, p.link_h2d_bytes_per_s) == (1e13, 5e11, 8e9)
    assert p.link_d2h_bytes_per_s == 6e9 and p.capacity_bytes == 8 << 30 and p.launch_s == 1e-5
    with pytest.raises(ValueError, match="missing"):
        get_target("custom:flops=10T")
    with pytest.raises(ValueError, match="not a rate"):
        get_target("custom:flops=fast,hbm=1G,link=1G,mem=1GiB")
    with pytest.raises(ValueError, match="valid targets"):
        get_target("gtx480")


def _compiled(spec, batch=16):
    from minidl.compile.engine import Engine
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.net.optim import make_optimizer

    net = smallcnn()
    eng = Engine(net, Pool(MetaDevice(kind="cuda")), spec, SoftmaxCrossEntropy(),
                 make_optimizer("sgd", net.parameters()), bind=False)
    return eng.compiled([(batch, 1, 28, 28)], (batch,), True)


def test_roofline_step_times():
    c = _compiled("none")
    prog = c.plan.program
    v100 = get_target("v100")
    for i, st in enumerate(prog.steps):
        touched = sum(prog.tensors[t].nbytes for t in set(st.access.reads) | set(st.access.writes))
        want = max(st.cost.flops / v100.flops_per_s, touched / v100.hbm_bytes_per_s) + v100.launch_s
        assert step_time(prog, i, v100) == pytest.approx(want)
    fast = replace(v100, flops_per_s=v100.flops_per_s * 1000, hbm_bytes_per_s=1e18)
    assert sum(step_costs(prog, fast)) < sum(step_costs(prog, v100))


def test_simulation_without_transfers_is_the_oracle():
    p = simulate(_compiled("reuse,inplace").plan, get_target("v100"))
    assert p.step_s == pytest.approx(p.oracle_s) and p.stall_s == 0 and p.overhead == 0
    assert p.offloaded_bytes == p.prefetched_bytes == 0


def test_simulation_of_swapping_stalls_on_a_slow_link():
    plan = _compiled("reuse,swap=all").plan
    assert plan.swapping.blocks
    moved = sum(plan.program.block_size(plan.program.tensors[t].nbytes)
                for t in plan.swapping.blocks)
    fast = simulate(plan, get_target("custom:flops=15T,hbm=900G,link=1e18,mem=16GiB"))
    slow = simulate(plan, get_target("custom:flops=15T,hbm=900G,link=1e6,mem=16GiB"))
    assert fast.offloaded_bytes == slow.offloaded_bytes == moved == slow.prefetched_bytes
    assert fast.stall_s == pytest.approx(0, abs=1e-9) and fast.overhead == pytest.approx(0)
    # at 1 MB/s every byte's two transfers are on the critical path at least once
    assert slow.stall_s >= moved / 1e6 and slow.step_s == pytest.approx(slow.oracle_s
                                                                      + slow.stall_s)


def test_recomputation_counts_its_forward_steps():
    p = simulate(_compiled("reuse,recompute=sqrt").plan, get_target("v100"))
    assert p.recompute_s > 0 and p.step_s == pytest.approx(p.oracle_s + p.recompute_s)


def test_dry_run_for_a_target_predicts_and_budgets_auto():
    rep = minidl.dry_run(smallcnn(), 64, "vdnn", target="v100")
    pred = rep["prediction"]
    assert pred["target"] == "v100" and pred["step_s"] >= pred["oracle_s"] > 0
    assert rep["device"] == "meta (cuda kind)"
    auto = minidl.dry_run(smallcnn(), 64, "auto", target="custom:flops=15T,hbm=900G,link=12G,"
                                                         "mem=12MiB")
    assert auto["peak_reserved_bytes"] <= 12 << 20  # the target's memory is auto's budget
    assert "cost model" in " ".join(auto["notes"])


def test_cli_plan_with_a_target():
    r = subprocess.run([sys.executable, "-m", "minidl", "plan", "smallcnn", "--batch-size", "64",
                        "--memory", "vdnn", "--target", "v100"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "predicted on v100" in r.stdout and "overhead" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "minidl", "plan", "smallcnn", "--target", "gtx"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "valid targets" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("planner", ["greedy", "optimal"])
def test_auto_estimate_is_the_simulated_overhead(planner):
    """Both planners price a choice by the same walk as the simulator: the estimated overhead of
    the plan taken equals the predicted one, swaps queued on a slow link included."""
    from minidl.memory.planners.auto import auto_choose, auto_plan, plan_extra
    from minidl.memory.planners.optimal import optimal_plan

    prof = get_target("custom:flops=15T,hbm=900G,link=2G,mem=16GiB")
    prog = _compiled("reuse,inplace", batch=64).lowered.program
    costs = step_costs(prog, prof)
    free = auto_choose(prog, None, costs, bandwidth=2e9).peak  # the smallest peak reached
    top = auto_plan(prog, None, costs).provenance.auto.peak
    make = auto_plan if planner == "greedy" else optimal_plan
    seen_extra = False
    for frac in (0.2, 0.5, 0.8):
        budget = int(free + frac * (top - free))
        plan = make(prog, budget, costs, bandwidth=2e9)
        pred = simulate(plan, prof)
        extra = plan.provenance.auto.extra_time_s
        assert extra == pytest.approx(pred.step_s - pred.oracle_s, rel=1e-9, abs=1e-12)
        assert plan_extra(plan, costs, 2e9) == pytest.approx(extra, abs=1e-12)
        seen_extra |= extra > 0
    assert seen_extra  # the slow link made some budget cost time


def test_auto_splits_the_batch_when_the_target_predicts_it_faster():
    """With a target, auto takes the number of micro-batches whose plan the cost model predicts
    fastest (one batch that must swap or recompute against two that need not, or the reverse
    where two micro-batches' launches cost more); below the whole batch's least peak, it
    splits."""
    chosen = set()
    for link, whole in (("1G", False), ("0.2G", False), ("1G", True), ("1G", None)):
        target = f"custom:flops=15T,hbm=900G,link={link},mem=16GiB"
        half = minidl.dry_run(smallcnn(), 32, "reuse,inplace", target=target)
        full = minidl.dry_run(smallcnn(), 64, "reuse,inplace", target=target)
        budget = full["peak_reserved_bytes"] if whole else int(half["peak_reserved_bytes"] * 1.1)
        if whole is None:  # below anything the whole batch reaches: only micro-batches fit
            least = least_reached(lambda b, t=target: minidl.dry_run(
                smallcnn(), 64, f"auto,budget={b},split=1", target=t))
            budget = least - 512
        rep = minidl.dry_run(smallcnn(), 64, f"auto,budget={budget}", target=target)
        assert rep["peak_reserved_bytes"] <= budget
        forced = {}
        for k in (1, 2):
            try:
                forced[k] = minidl.dry_run(smallcnn(), 64, f"auto,budget={budget},split={k}",
                                           target=target)["prediction"]["step_s"]
            except MemoryError:
                pass
        assert rep["prediction"]["step_s"] == pytest.approx(min(forced.values()))
        chosen.add(rep["split"])
    assert chosen == {1, 2}
