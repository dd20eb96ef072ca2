"""``offload=parameters``: the trainable parameters live on the host and each step's are
streamed in ahead of it (memory/passes/stream_parameters.py). Training is bit-identical to
on-device training in every precision, the dry run is the real run, checkpoints resume, and
the plan keeps its prefetch distance and its cap on bytes in flight."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.compile.engine import Engine
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.names import Role
from minidl.memory.ir.plan import Await, Free, Offload, Prefetch
from minidl.memory.ir.program import Program
from minidl.memory.passes.stream_parameters import stream_parameters_plan
from minidl.memory.planners.planner import make_plan
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import Adam, AdamW

from .test_offload_half_parameters import _cnn, _cnn_batch, _gpt, _gpt_batch, _train

STREAM = "offload=parameters"


@pytest.mark.parametrize("make,batch,optimizer,spec,precision", [
    (_cnn, _cnn_batch, Adam, "reuse,inplace", "fp32"),
    (_cnn, _cnn_batch, Adam, "reuse,inplace", "bf16-mixed"),
    (_gpt, _gpt_batch, AdamW, "reuse,inplace,recompute=sqrt", "fp32"),
    (_gpt, _gpt_batch, AdamW, "reuse,inplace,recompute=sqrt", "fp16-mixed"),
])
def test_training_is_bit_identical_and_the_dry_run_is_the_real_run(make, batch, optimizer, spec,
                                                                    precision):
    on_device = _train(make, batch(), spec, optimizer, precision)
    streamed = _train(make, batch(), f"{spec},{STREAM}", optimizer, precision)
    assert streamed[0] == on_device[0]  # losses
    for a, b in ((on_device[1], streamed[1]), (on_device[2], streamed[2])):
        assert a.keys() == b.keys()
        for k in a:  # float32 parameters (the host's masters) and optimizer state
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    x, _ = batch()
    rep = minidl.dry_run(make(), len(x), f"{spec},{STREAM}",
                         "adam" if optimizer is Adam else "adamw", input_shape=x.shape[1:],
                         precision=precision)
    assert (rep["peak_allocated_bytes"], rep["peak_reserved_bytes"],
            rep["host_state_bytes"]) == streamed[3]
    assert streamed[3][0] < on_device[3][0]


def _engine(spec: str, precision: str = "fp32") -> tuple[Engine, object]:
    x, _ = _gpt_batch()
    net = _gpt()
    engine = Engine(net, Pool(MetaDevice()), spec, SoftmaxCrossEntropy(),
                    AdamW(net.parameters()), bind=False, precision=precision)
    return engine, engine.compiled([x.shape], x.shape, True).plan


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_device_keeps_no_trainable_parameter_and_the_host_keeps_the_half_copies(precision):
    _, optimizer_plan = _engine("reuse,inplace,offload=optimizer", precision)
    engine, plan = _engine(f"reuse,inplace,{STREAM}", precision)
    prog = plan.program
    trainable = {p.name for p in engine.net.parameters() if p.trainable}
    assert not any(t.persistent and t.name in trainable for t in prog.tensors)
    assert prog.persistent_bytes() < optimizer_plan.program.persistent_bytes()
    streamed = set(plan.swapping.host_homed)
    assert streamed == {t.id for t in prog.tensors if t.role == Role.PARAM
                        and not t.persistent}
    state = engine.host_state
    half = state.by_kind().get("half_parameters", 0)
    assert (half > 0) == (precision != "fp32")
    assert state.upload_bytes == 0  # nothing crosses the link after the update
    plan.validate()


def _fetch_points(plan) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Tensor -> the steps whose ``before`` prefetches / awaits it."""
    fetch: dict[int, list[int]] = {}
    wait: dict[int, list[int]] = {}
    for i, sp in enumerate(plan.steps):
        for a in sp.before:
            if isinstance(a, Prefetch):
                fetch.setdefault(a.tensor, []).append(i)
            elif isinstance(a, Await):
                wait.setdefault(a.tensor, []).append(i)
    return fetch, wait


@pytest.mark.parametrize("distance,inflight", [(1, 1 << 30), (3, 1 << 30), (2, 4096), (2, 0)])
def test_prefetches_keep_their_distance_and_the_cap_on_bytes_in_flight(distance, inflight):
    # the program lowered for streaming, planned without it: the pass alone on its plan; its
    # recomputations read their forward's parameter tensors (as a program whose recomputed
    # steps do not fetch their own copies would), so those tensors have two visits each
    _, streamed_plan = _engine(f"reuse,inplace,recompute=sqrt,{STREAM}")
    prog = streamed_plan.program
    back = {t.id: t.of for t in prog.tensors if t.role == Role.PARAM and t.of >= 0}
    assert back  # (the recomputations read copies of their own)
    base = Program(tensors=prog.tensors, steps=[st.remapped(back) for st in prog.steps],
                   inputs=prog.inputs, loss=prog.loss, training=True, alignment=prog.alignment)
    unstreamed = make_plan(base, MemoryConfig.parse("reuse,inplace"))
    plan = stream_parameters_plan(unstreamed, distance, inflight)
    plan.validate()
    fetch, wait = _fetch_points(plan)
    sizes = base.block_sizes
    points = sorted({s for steps in wait.values() for s in steps})
    assert set(fetch) == set(wait) == set(plan.swapping.host_homed) == \
        {t.id for t in base.tensors if t.role == Role.PARAM and not t.persistent
         and t.id not in back}
    ahead = [0] * len(plan.steps)
    for t in fetch:
        assert len(fetch[t]) == len(wait[t])
        for f, w in zip(fetch[t], wait[t]):
            assert f <= w and sum(1 for p in points if f <= p < w) <= distance
            for s in range(f, w):
                ahead[s] += sizes[t]
    # the cap holds wherever a prefetch was issued ahead of its own step
    for t in fetch:
        for f, w in zip(fetch[t], wait[t]):
            if f < w:
                assert max(ahead[f:w]) <= inflight
    if inflight == 0:
        assert all(f == w for t in fetch for f, w in zip(fetch[t], wait[t]))
    else:
        assert any(f < w for t in fetch for f, w in zip(fetch[t], wait[t]))
    # a tensor read again later (a recomputation) is dropped between its visits, at no copy
    dropped = [a.tensor for sp in plan.steps for a in sp.after if isinstance(a, Offload)]
    assert dropped and set(dropped) <= set(plan.swapping.host_homed)
    freed = {a.tensor for sp in plan.steps for a in sp.after if isinstance(a, Free)}
    assert set(plan.swapping.host_homed) <= freed


def test_the_host_homed_offload_copies_nothing_in_the_cost_model():
    from minidl.memory.cost.cost_model import simulate
    from minidl.memory.cost.targets import get_target
    _, plan = _engine(f"reuse,inplace,recompute=sqrt,{STREAM}")
    pred = simulate(plan, get_target("v100"))
    sizes = plan.program.block_sizes
    fetched = sum(sizes[a.tensor] for sp in plan.steps for a in sp.before
                  if isinstance(a, Prefetch))
    grads = sum(sizes[a.tensor] for sp in plan.steps for a in sp.after
                if isinstance(a, Offload) and a.tensor not in plan.swapping.host_homed)
    assert pred.prefetched_bytes == fetched > 0
    assert pred.offloaded_bytes == grads > 0


@pytest.mark.parametrize("spec,message", [
    ("reuse,prefetch=2", r"memory flag 'prefetch' paces streamed parameters: add "
                         r"offload=parameters"),
    ("reuse,offload=optimizer,inflight=1MiB", r"memory flag 'inflight' paces streamed"),
    ("reuse,offload=parameters,prefetch=0", r"'prefetch' needs a positive integer, got '0'"),
])
def test_bad_pacing_flags_are_refused_in_one_line(spec, message):
    with pytest.raises(ValueError, match=message):
        MemoryConfig.parse(spec)
    cfg = MemoryConfig.parse("reuse,offload=parameters,prefetch=3,inflight=64MiB")
    assert (cfg.prefetch, cfg.inflight) == (3, 64 << 20)


@pytest.mark.parametrize("kept,policy", [(0, None), (40, "optimizer"), (50, "optimizer"),
                                         (51, "parameters"), (150, "parameters")])
def test_auto_streams_when_the_kept_parameters_take_over_half_the_budget(kept, policy):
    from minidl.memory.ir.config import OffloadPolicy
    from minidl.memory.planners.offload_choice import with_offload_if_needed
    config = MemoryConfig.parse("auto,budget=100")
    persistent = 100 if kept else 99  # (below the budget: nothing to offload)
    out, note = with_offload_if_needed(config, persistent, 60, kept)
    if policy is None:
        assert out is config and note == ""
        return
    assert out.offload is OffloadPolicy.of(policy) and out.budget == 100
    assert f"offload={policy}" in note and ("streamed" in note) == (policy == "parameters")
    # a spec that names its own offload, or no budget, is left as it is
    for spec in ("auto,budget=100,offload=optimizer", "reuse,inplace"):
        given = MemoryConfig.parse(spec)
        assert with_offload_if_needed(given, persistent, 60, kept) == (given, "")


def test_swap_stats_and_the_report_count_the_parameters_streamed_in(capsys):
    from minidl.cli import main
    net = _gpt()
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-2), device_memory="32MiB",
                        memory=f"reuse,inplace,recompute=sqrt,{STREAM}")
    x, y = _gpt_batch()
    tr.step(x, y)
    tr.step(x, y)
    plan, s = tr.last_compiled.plan, tr.swap_stats
    sizes = plan.program.block_sizes
    fetched = sum(sizes[a.tensor] for sp in plan.steps for a in sp.before
                  if isinstance(a, Prefetch))
    assert s["streamed_parameter_bytes"] == s["prefetched_bytes"] == fetched > 0
    assert s["uploaded_parameter_bytes"] == 0
    tr.close()
    argv = ["train", "gpt-char", "--dataset", "synthetic", "--seq-len", "8", "--width", "12",
            "--batch-size", "2", "--max-steps", "2", "--no-progress", "--optimizer", "adam",
            "--memory", f"reuse,{STREAM}"]
    assert main(argv) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "offloaded per step" in ln]
    assert len(line) == 1 and " to the host, parameters " in line[0]
    assert line[0].split("parameters ")[1].split(" streamed in;")[0] != "0 B"
