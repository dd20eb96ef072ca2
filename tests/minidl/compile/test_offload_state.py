"""Persistent state on the host (``offload=optimizer``, ZeRO-Offload): the spec's flag, the
device and host bytes of a plan, training bit-identical to on-device training, dry-run peak
== real peak, checkpoints and resume, the host-memory budget and ``auto`` choosing it."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.cli import main
from minidl.memory.ir.config import MemoryConfig, OffloadPolicy
from minidl.memory.ir.names import Role
from minidl.memory.ir.plan import Offload, Release
from minidl.memory.ir.program import aligned
from minidl.net.optim import Adam, AdamW
from minidl.zoo import models
from minidl.zoo.transformers import TransformerConfig, gpt

TINY = TransformerConfig(layers=2, heads=2, dim=32, context=8, vocab=11, dropout=0.1)
SPECS = ("reuse,inplace", "reuse,inplace,offload=optimizer")


def test_the_flag_parses_typed_and_bad_values_name_the_valid_ones():
    assert MemoryConfig.parse("reuse,offload=optimizer").offload is OffloadPolicy.OPTIMIZER
    assert MemoryConfig.parse("reuse").offload is None
    assert MemoryConfig.parse("reuse,offload=parameters").offload is OffloadPolicy.PARAMETERS
    with pytest.raises(ValueError, match=r"^memory flag 'offload' needs a value in "
                                         r"optimizer\|parameters \(got 'params'\)$"):
        MemoryConfig.parse("reuse,offload=params")
    with pytest.raises(ValueError, match="split=2 cannot be combined with offload"):
        MemoryConfig.parse("reuse,split=2,offload=optimizer")


def _cnn():
    return models.smallcnn((1, 8, 8), 10, width=2)


def _gpt():
    return gpt(TINY, name="tiny-gpt")


def _cnn_batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)


def _gpt_batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, TINY.vocab, (3, TINY.context)), rng.integers(0, TINY.vocab,
                                                                        (3, TINY.context))


def _train(make, batch, spec, optimizer, steps=3):
    net = make()
    tr = minidl.Trainer(net, optimizer(net.parameters(), lr=1e-2), memory=spec,
                        device_memory="32MiB", debug=True)
    x, y = batch
    losses = [tr.step(x, y) for _ in range(steps)]
    out = (losses, {k: np.array(v) for k, v in net.state_dict().items()},
           {k: np.array(v) for k, v in tr.optimizer.state_dict().items()},
           tr.memory_report()["peak_allocated_bytes"])
    tr.close()
    return out


@pytest.mark.parametrize("make,batch,optimizer", [(_cnn, _cnn_batch, Adam),
                                                  (_gpt, _gpt_batch, AdamW)])
def test_training_is_bit_identical_and_the_dry_run_peak_is_the_real_one(make, batch, optimizer):
    runs = {spec: _train(make, batch(), spec, optimizer) for spec in SPECS}
    on_device, offloaded = runs.values()
    assert offloaded[0] == on_device[0]  # losses
    for a, b in ((on_device[1], offloaded[1]), (on_device[2], offloaded[2])):
        assert a.keys() == b.keys()
        for k in a:
            assert np.array_equal(a[k], b[k]), k
    name = "adam" if optimizer is Adam else "adamw"
    x, _ = batch()
    for spec, run in runs.items():
        rep = minidl.dry_run(make(), len(x), spec, name, input_shape=x.shape[1:])
        assert rep["peak_allocated_bytes"] == run[3], spec
    assert offloaded[3] < on_device[3]


def test_the_plan_keeps_parameters_on_the_device_and_the_rest_on_the_host():
    x, _ = _gpt_batch()
    on, off = (minidl.dry_run(_gpt(), len(x), spec, "adamw") for spec in SPECS)
    params = on["persistent_bytes"] // 4  # parameters, gradients, two Adam slots alike
    assert off["persistent_bytes"] == params
    assert off["host_state_bytes"] == 4 * params  # master, gradients, two slots
    assert off["host_state"] == {"master": params, "gradient": params,
                                 "optimizer_state": 2 * params}
    assert on["host_state_bytes"] == 0
    assert on["peak_allocated_bytes"] - off["peak_allocated_bytes"] >= 2 * params
    # every parameter gradient leaves the device by the plan's own offload / release actions
    net = _gpt()
    tr = minidl.Trainer(net, AdamW(net.parameters()), memory=SPECS[1], device_memory="32MiB")
    tr.step(*_gpt_batch())
    plan = tr.last_compiled.plan
    prog = plan.program
    grads = {t.id for t in prog.tensors if t.role == Role.PARAM_GRAD}
    assert grads and not any(prog.tensors[t].persistent for t in grads)
    actions = [a for _, a in plan.actions()]
    assert {a.tensor for a in actions if isinstance(a, Offload)} == grads
    assert {a.tensor for a in actions if isinstance(a, Release)} == grads
    assert not any(t.role == Role.OPT_STATE for t in prog.tensors)
    plan.validate()
    tr.close()


def test_checkpoint_and_resume_are_unchanged(tmp_path):
    x, y = _cnn_batch()
    straight = _train(_cnn, (x, y), SPECS[1], Adam, steps=4)[0]
    net = _cnn()
    tr = minidl.Trainer(net, Adam(net.parameters(), lr=1e-2), memory=SPECS[1],
                        device_memory="32MiB")
    first = [tr.step(x, y) for _ in range(2)]
    tr.save(tmp_path / "c.npz")
    tr.close()
    net2 = _cnn()
    for p in net2.parameters():  # other weights: everything must come from the checkpoint
        p.data[...] += 1
    tr2 = minidl.Trainer(net2, Adam(net2.parameters(), lr=1e-2), memory=SPECS[1],
                         device_memory="32MiB")
    tr2.load(tmp_path / "c.npz", resume=True)
    assert first + [tr2.step(x, y) for _ in range(2)] == straight
    tr2.close()


def test_host_memory_is_a_budget_on_plan(capsys):
    args = ["plan", "gpt-char", "--batch-size", "2", "--memory", "reuse,offload=optimizer"]
    assert main(args + ["--json"]) == 0
    import json

    rep = json.loads(capsys.readouterr().out)
    assert rep["host_bytes"] >= rep["host_state_bytes"] > 0
    assert main(args + ["--host-memory", "1KiB"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--host-memory is" in err[0]
    assert main(args) == 0
    assert "host memory:" in capsys.readouterr().out


def test_auto_offloads_when_the_persistent_state_fills_the_budget():
    x, _ = _gpt_batch()
    on = minidl.dry_run(_gpt(), len(x), "reuse,inplace", "adamw")
    budget = on["persistent_bytes"] - 4096  # the state alone does not fit
    rep = minidl.dry_run(_gpt(), len(x), f"auto,budget={budget}", "adamw")
    assert rep["host_state_bytes"] > 0
    assert any(n.startswith("auto: the persistent state") for n in rep["notes"])
    assert rep["peak_allocated_bytes"] <= budget
    roomy = minidl.dry_run(_gpt(), len(x), "auto,budget=64MiB", "adamw")
    assert roomy["host_state_bytes"] == 0


def test_auto_with_offload_never_exceeds_its_budget():
    """The gradients' copies keep each gradient on the device a step longer than the planner's
    candidates did: at every budget ``auto,offload=optimizer`` either fits it (placed peak,
    re-planned lower where the copies pushed it over) or refuses it, never above it."""
    from minidl.memory.planners.auto import BudgetTooSmall

    x, _ = _gpt_batch()
    low = minidl.dry_run(_gpt(), len(x), "reuse,inplace,offload=optimizer", "adamw")
    top = low["peak_reserved_bytes"]
    fitted = refused = 0
    for share in (1.0, 0.95, 0.9, 0.8):
        budget = int(top * share)
        try:
            rep = minidl.dry_run(_gpt(), len(x), f"auto,budget={budget},offload=optimizer",
                                 "adamw")
        except BudgetTooSmall as e:
            refused += 1
            assert f"{budget:,} B" in str(e)  # (the user's budget, not a lowered one)
            continue
        fitted += 1
        assert rep["peak_reserved_bytes"] <= budget, share
    assert fitted and refused


@pytest.mark.parametrize("emulated", [False, True])
def test_the_parameters_go_back_over_the_emulated_link(emulated):
    """With ``emulate_link`` the host update's copy back goes through the throttled copy
    engine (it takes the link's time, as the gradients' copies do); without, a plain copy."""
    x, y = _cnn_batch()
    net = _cnn()
    link = "custom:flops=15.7T,hbm=900G,link=1000G,mem=16GiB" if emulated else None
    tr = minidl.Trainer(net, Adam(net.parameters(), lr=1e-2), memory=SPECS[1],
                        device_memory="32MiB", emulate_link=link)
    tr.step(x, y)
    engine = tr.device.copy_engine
    before = engine.total_bytes
    tr.optimizer.step()
    moved = tr.engine.host_state.upload_bytes  # (in chunks: the parameters' whole blocks)
    assert moved >= sum(p.data.nbytes for p in net.parameters())
    assert engine.total_bytes - before == (moved if emulated else 0)
    tr.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_swap_stats_count_the_gradients_out_and_the_parameters_back(capsys, precision):
    net = _gpt()
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-2), device_memory="32MiB",
                        memory="reuse,inplace,offload=optimizer", precision=precision)
    x, y = _gpt_batch()
    tr.step(x, y)
    tr.step(x, y)
    host, s = tr.engine.host_state, tr.swap_stats
    prog = tr.last_compiled.lowered.program
    grads = sum(aligned(t.nbytes, prog.alignment) for t in prog.tensors  # (device blocks)
                if t.role == Role.PARAM_GRAD and not t.persistent)
    assert s["offloaded_gradient_bytes"] == s["offloaded_bytes"] == grads > 0
    assert s["uploaded_parameter_bytes"] == host.upload_bytes
    half = precision != "fp32"  # (the matrix ops' weights come back as half copies)
    assert (host.upload_bytes < host.array_bytes) == half
    assert s["host_update_s"] > 0 and s["parameter_upload_s"] > 0
    assert minidl.Trainer(_gpt(), device_memory="32MiB").swap_stats == {}
    argv = ["train", "gpt-char", "--dataset", "synthetic", "--seq-len", "8", "--width", "12",
            "--batch-size", "2", "--max-steps", "2", "--no-progress", "--optimizer", "adam",
            "--memory", "reuse,offload=optimizer", "--precision", precision]
    assert main(argv) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "offloaded per step" in ln]
    assert len(line) == 1 and " to the host, parameters " in line[0]
    assert "; host update " in line[0] and ", copy back " in line[0]
