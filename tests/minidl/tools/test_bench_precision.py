"""``minidl bench --precision``: minidl's trainers compute in the precision, and PyTorch's twin
(``--compare-torch``, in its own process) runs its forward under ``torch.autocast`` in the
matching half dtype."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from minidl.memory.ir.config import MemoryConfig
from minidl.tools.bench import run_bench
from minidl.zoo.models import get_model


def _make():
    return get_model("lenet5", (1, 28, 28), 10)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_bench_trains_in_the_precision(precision):
    out = run_bench(_make, (1, 28, 28), 4, [MemoryConfig.parse("reuse,inplace")], steps=1,
                    warmup=0, progress=False, block=1, precision=precision)
    fp32 = run_bench(_make, (1, 28, 28), 4, [MemoryConfig.parse("reuse,inplace")], steps=1,
                     warmup=0, progress=False, block=1)
    assert out["precision"] == precision and fp32["precision"] == "fp32"
    # half feature maps: the mixed step peaks below the float32 one
    assert out["results"][0]["peak_allocated_bytes"] < fp32["results"][0]["peak_allocated_bytes"]


@pytest.mark.parametrize("precision, half", [("bf16-mixed", "bfloat16"), ("fp16-mixed", "float16")])
def test_torch_twin_runs_under_autocast(precision, half):
    torch = pytest.importorskip("torch")
    from minidl.tools.bench import _torch_runner, synthetic_batch

    net = _make()
    x, y = synthetic_batch(net, (1, 28, 28), 4, 0)
    seen = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(o.dtype) if isinstance(o, torch.Tensor) else None)
    try:
        loss = _torch_runner(net, x, y, 0.01, "cpu", precision)()
    finally:
        hook.remove()
    assert np.isfinite(loss)
    assert getattr(torch, half) in seen  # the convolutions and linear layers ran in half


def test_cli_reports_the_precision():
    res = subprocess.run([sys.executable, "-m", "minidl", "bench", "lenet5", "--batch-size", "4",
                          "--steps", "1", "--warmup", "0", "--memory", "reuse,inplace",
                          "--precision", "bf16-mixed", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["precision"] == "bf16-mixed"
