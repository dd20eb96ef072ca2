"""Precision in plans: the dtypes lowering gives every tensor, peaks under mixed precision,
the cost model's rate per precision, and ``--precision`` on the command line."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.cli import main
from minidl.compile.lowering import lower
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.cost.cost_model import rate_breakdown, step_rate, step_time
from minidl.memory.cost.targets import PROFILES, get_target
from minidl.memory.ir.precision import Precision, is_float, itemsize, op_dtype, promoted
from minidl.zoo.models import get_model, smallcnn


def _lowered(precision, net=None, batch=8):
    net = net or smallcnn()
    return lower(net, [(batch, 1, 28, 28)], loss=SoftmaxCrossEntropy(), label_shape=(batch,),
                 precision=precision)


def test_precision_values_and_one_line_errors():
    assert Precision.of("bf16-mixed") is Precision.BF16_MIXED
    assert Precision.BF16_MIXED.half_dtype == "bfloat16"
    assert Precision.FP16_MIXED.matmul_dtype == "float16"
    assert Precision.TF32.matmul_dtype == "tf32" and Precision.FP32.matmul_dtype == ""
    with pytest.raises(ValueError) as e:
        Precision.of("fp8")
    assert "\n" not in str(e.value)
    assert "fp32, tf32, bf16-mixed, fp16-mixed" in str(e.value)


def test_op_policy_follows_autocast():
    bf16 = Precision.BF16_MIXED
    assert op_dtype("conv", ["float32"], bf16) == "bfloat16"
    assert op_dtype("loss", ["bfloat16"], bf16) == "float32"
    assert op_dtype("norm", ["bfloat16"], bf16) == "float32"
    assert op_dtype("relu", ["bfloat16"], bf16) == "bfloat16"
    assert op_dtype("add", ["bfloat16", "float32"], bf16) == "float32"  # type promotion
    assert op_dtype("embedding", [], bf16) == "float32"  # (its weight's dtype)
    assert op_dtype("conv", ["float32"], Precision.TF32) == "float32"
    assert promoted(["float16", "bfloat16"]) == "float32"
    assert itemsize("bfloat16") == 2 and is_float(np.dtype("bfloat16"))


def test_fp32_lowering_is_unchanged():
    a, b = _lowered("fp32").program, lower(
        smallcnn(), [(8, 1, 28, 28)], loss=SoftmaxCrossEntropy(), label_shape=(8,)).program
    assert [(t.name, t.shape, t.dtype) for t in a.tensors] == \
        [(t.name, t.shape, t.dtype) for t in b.tensors]
    assert all(st.cost.matmul_dtype == "" for st in a.steps)


@pytest.mark.parametrize("precision, half", [("bf16-mixed", "bfloat16"),
                                             ("fp16-mixed", "float16")])
def test_mixed_lowering_dtypes(precision, half):
    prog = _lowered(precision).program
    by_name = {t.name: t for t in prog.tensors}
    # the data and labels as fed; parameters, their gradients: float32 (master copies)
    assert prog.tensors[prog.inputs[0]].dtype == "float32"
    for t in prog.tensors:
        if t.persistent:
            assert t.dtype == "float32", t.name
    maps = [t for t in prog.tensors if t.category == "feature_map" and t.name != "loss"]
    assert maps and all(t.dtype == half for t in maps)  # conv, relu, pool, linear outputs
    assert by_name["loss"].dtype == "float32"  # autocast's float32 list
    # gradients of feature maps take their value's dtype, and are half-size
    for t in prog.tensors:
        if t.role == "grad" and t.of >= 0:
            assert t.dtype == prog.tensors[t.of].dtype
            assert t.nbytes == int(np.prod(t.shape)) * 2
    # every step of a matrix op rounds its weights to half itself, in its workspace (no copy
    # kept from forward to backward)
    assert not [t for t in prog.tensors if t.name.endswith(f"@{half}") and "weight" in t.name]
    for st in prog.steps:
        if st.kind in ("conv", "linear"):
            assert st.forward.param_casts == {"weight": half, "bias": half}, st.label
    # the first conv keeps a half cast of the float32 input for its backward
    first = prog.steps[0]
    assert first.kind == "conv" and not first.backward.retained_inputs
    assert any(prog.tensors[t].dtype == half for t in first.forward.stash.values())
    # matrix steps carry their product dtype; others none
    for st in prog.steps:
        want = half if st.kind in ("conv", "linear") else ""
        assert st.cost.matmul_dtype == want, (st.label, st.cost.matmul_dtype)


def test_tf32_keeps_float32_tensors():
    a, b = _lowered("fp32").program, _lowered("tf32").program
    assert [t.nbytes for t in a.tensors] == [t.nbytes for t in b.tensors]
    assert {st.cost.matmul_dtype for st in b.steps if st.kind == "conv"} == {"tf32"}


def test_rates_per_precision():
    a100, v100, titan = get_target("a100"), get_target("v100"), get_target("titanx")
    assert a100.matmul_rate("") == ("fp32", 19.5e12)
    assert a100.matmul_rate("tf32") == ("tf32 tensor", 156e12)
    assert a100.matmul_rate("bfloat16") == ("bf16 tensor", 312e12)
    assert v100.matmul_rate("float16") == ("fp16 tensor", 125e12)
    assert v100.matmul_rate("bfloat16") == ("fp32 (no bf16 units)", 15.7e12)
    assert v100.matmul_rate("tf32")[1] == 15.7e12
    assert titan.matmul_rate("float16") == ("fp32 (no fp16 units)", 6.6e12)
    assert get_target("h100").tensor_cores.bf16 == 989.4e12
    for p in PROFILES.values():  # tensor rates never below FP32 where present
        for r in (p.tensor_cores.tf32, p.tensor_cores.fp16, p.tensor_cores.bf16):
            assert r == 0 or r >= p.flops_per_s
    custom = get_target("custom:flops=10T,hbm=1T,link=10G,mem=8GiB,bf16=100T")
    assert custom.matmul_rate("bfloat16") == ("bf16 tensor", 1e14)


def test_steps_priced_at_their_precision():
    a100 = get_target("a100")
    fp32, bf16 = _lowered("fp32", batch=256).program, _lowered("bf16-mixed", batch=256).program
    for i, st in enumerate(bf16.steps):
        name, rate = step_rate(st, a100)
        assert name == ("bf16 tensor" if st.kind in ("conv", "linear") else "fp32")
        touched = sum(bf16.tensors[t].nbytes for t in set(st.access.reads) | set(st.access.writes))
        want = max(st.cost.flops / rate, touched / a100.hbm_bytes_per_s) + a100.launch_s
        assert step_time(bf16, i, a100) == want
    # a bandwidth-bound step moves half the bytes: relu's forward
    relu = next(i for i, st in enumerate(fp32.steps) if st.kind == "relu")
    assert step_time(bf16, relu, a100) - a100.launch_s == pytest.approx(
        (step_time(fp32, relu, a100) - a100.launch_s) / 2, rel=1e-6)
    rates = rate_breakdown(bf16, a100)
    assert set(rates) == {"bf16 tensor", "fp32"}
    assert sum(r["steps"] for r in rates.values()) == len(bf16.steps)


def test_bf16_peak_under_055_of_fp32():
    from minidl import dry_run

    shape = (3, 32, 32)
    peaks = {p: dry_run(get_model("resnet20", shape, 10), 64, "reuse,inplace",
                        input_shape=shape, precision=p)["peak_allocated_bytes"]
             for p in ("fp32", "bf16-mixed", "fp16-mixed", "tf32")}
    assert peaks["bf16-mixed"] == peaks["fp16-mixed"] <= 0.55 * peaks["fp32"]
    assert peaks["tf32"] == peaks["fp32"]


def test_dry_run_reports_bytes_by_dtype_and_rates():
    from minidl import dry_run

    rep = dry_run(smallcnn(), 32, "reuse,inplace", precision="bf16-mixed", target="a100")
    assert rep["precision"] == "bf16-mixed"
    assert set(rep["peak_bytes_by_dtype"]) >= {"bfloat16", "float32"}
    assert {r[3] for r in rep["step_rates"]} == {"bf16 tensor", "fp32"}
    assert "precision" not in dry_run(smallcnn(), 32, "reuse,inplace")  # fp32: as before


def test_cli_precision(capsys):
    code = main(["plan", "lenet5", "--batch-size", "4", "--precision", "bf16"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "fp32, tf32, bf16-mixed, fp16-mixed" in err
    code = main(["plan", "lenet5", "--batch-size", "4", "--precision", "fp16-mixed",
                 "--target", "v100"])
    out = capsys.readouterr().out
    assert code == 0 and "precision fp16-mixed: at the peak" in out and "float16 " in out
    assert "fp16 tensor" in out
    code = main(["train", "lenet5", "--dataset", "digits", "--max-steps", "1",
                 "--precision", "tf32"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "GPU setting" in err
