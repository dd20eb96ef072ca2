"""The host optimizer: one fused pass of kernels/pointwise/optim.py over a flat float32 group
(parameters back to back, alignment gaps between them, on the parallel path) gives every
parameter's own update bit for bit; benchmarks/offload/host_adam.py times it against PyTorch's
CPU Adam in processes of their own and agrees with it to float32 rounding."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minidl.kernels.pointwise import optim as ko
from minidl.net.optim import SGD, Adam, AdamW, FlatGroup
from minidl.net.parameter import Parameter

SHAPES = ((300, 300), (7,), (128, 600), (3, 5))  # (two above PARALLEL_MIN_SIZE: chunked)
ALIGN = 128  # elements between parameter starts (the pool's alignment, as zeros)
OPTIMIZERS = {
    "sgd-momentum": (SGD, dict(lr=0.1, momentum=0.9)),
    "sgd-nesterov-wd": (SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (Adam, dict(lr=1e-2)),
    "adam-l2": (Adam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "adamw": (AdamW, dict(lr=3e-2, weight_decay=0.3)),
}


def _offsets() -> tuple[list[int], int]:
    starts, at = [], 0
    for s in SHAPES:
        starts.append(at)
        at += -(-math.prod(s) // ALIGN) * ALIGN
    return starts, at


def _flat_optimizer(cls, kw, values: list[np.ndarray]):
    """An optimizer over parameters that are views of one flat range, grouped as the trainer
    groups them; returns it, its parameters and the flat gradient."""
    starts, total = _offsets()
    flat = {k: np.zeros(total, np.float32) for k in ("data", "grad")}

    def view(arr: np.ndarray, i: int) -> np.ndarray:
        return arr[starts[i]:starts[i] + math.prod(SHAPES[i])].reshape(SHAPES[i])

    params = []
    for i, v in enumerate(values):
        p = Parameter(f"p{i}", view(flat["data"], i))
        p.data[...] = v
        p.grad = view(flat["grad"], i)
        params.append(p)
    opt = cls(params, **kw)
    slots = {s: np.zeros(total, np.float32) for s in opt.slots}
    names = {p.name: i for i, p in enumerate(params)}
    opt.init_state(lambda name, shape, dtype: view(slots[name.rsplit(".", 1)[1]],
                                                   names[name.rsplit(".", 1)[0]]))
    opt.flat_groups = [FlatGroup(tuple(params), flat["data"], flat["grad"], slots,
                                 tuple((p.data, p.grad) for p in params))]
    return opt, params, flat


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_pass_over_a_flat_group_is_every_parameters_own_update(name):
    cls, kw = OPTIMIZERS[name]
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    flat_opt, flat_params, flat = _flat_optimizer(cls, kw, values)
    own = [Parameter(f"p{i}", v.copy()) for i, v in enumerate(values)]
    own_opt = cls(own, **kw)
    own_opt.init_state(lambda name, shape, dtype: np.zeros(shape, dtype))
    assert flat["data"].size >= ko.PARALLEL_MIN_SIZE and flat_opt.flat_groups[0].applies()
    for _ in range(4):
        grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        for p, q, g in zip(flat_params, own, grads, strict=True):
            p.grad[...] = g
            q.grad = g.copy()
        flat_opt.step()
        own_opt.step()
    for p, q in zip(flat_params, own, strict=True):
        assert np.array_equal(p.data, q.data), p.name
    for slot in flat_opt.slots:
        for p, q in zip(flat_params, own, strict=True):
            assert np.array_equal(flat_opt.state[f"{p.name}.{slot}"],
                                  own_opt.state[f"{q.name}.{slot}"]), (p.name, slot)
    data = flat["data"]
    mask = np.ones(data.size, bool)
    starts, _ = _offsets()
    for s, shape in zip(starts, SHAPES, strict=True):
        mask[s:s + math.prod(shape)] = False
    assert not np.any(data[mask])  # (the alignment gaps stay zeros)


@pytest.mark.slow
def test_the_host_adam_benchmark_times_torch_in_processes_of_its_own():
    pytest.importorskip("torch")
    bench = Path(__file__).resolve().parents[3] / "benchmarks" / "offload"
    code = (f"import sys; sys.path.insert(0, {str(bench)!r}); import host_adam; "
            "host_adam.main(['--params', '200000', '--rounds', '1', '--block', '1']); "
            "print('torch in parent:', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "torch in parent: False" in out
    assert "ratio minidl/torch-fused" in out and "ratio minidl/torch-foreach" in out
    for line in out.splitlines():
        if line.startswith("max difference"):
            assert float(line.split(": ")[1].split()[0]) < 1e-6, line
