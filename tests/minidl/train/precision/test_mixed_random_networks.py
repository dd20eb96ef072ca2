"""Random networks (conv, activations, BatchNorm, dropout, adds, concats, max pooling) in
bf16-mixed and fp16-mixed: every lossless memory spec gives the bits of ``none`` within the
precision, on the CPU and on the strict CUDA test device (where conv / ReLU / max pooling take
their half arrays as they are and the other layers compute on float32 copies staged in their
steps' workspaces); the dry run's peak equals the run's (on the device with its measured
scratch block, which holds CuPy's own temporaries only); and the device computes what the CPU
does, to the last-bit differences of its float32 kernels."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minidl
from minidl.compile import mixed_staging
from minidl.memory.runtime.transfer import to_host
from minidl.net.optim import SGD
from tests.minidl.random_nets import random_networks

strict = pytest.importorskip("minidl.memory.testing.strict_device")

MIXED = ["bf16-mixed", "fp16-mixed"]
#: Unit roundoff of each half dtype.
EPS = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}
SPECS = ["reuse,inplace", "reuse,inplace,static", "reuse,swap=all", "reuse,recompute=sqrt",
         "reuse,inplace,recompute=cost,swap=all", "reuse,inplace,binarize", "gist"]
DATA_DEPENDENT = ("gist",)


_empty = mixed_staging.Staging.empty


def _staged_in_the_workspace(self, shape, dtype):
    """Staging.empty, failing where a device step's array does not fit the workspace the
    lowering sized (the plan would then miss it)."""
    a = _empty(self, shape, dtype)
    assert self.spilled == 0, f"a staged {dtype} array of {shape} spilled out of the workspace"
    return a


def _run(make, x, y, precision, spec, device, steps=2):
    net = make()
    dev = strict.StrictCudaDevice("64MiB") if device == "strict" else "cpu"
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                        device=dev, device_memory="64MiB", precision=precision)
    with mock.patch.object(mixed_staging.Staging, "empty", _staged_in_the_workspace):
        losses = [tr.step(x, y) for _ in range(steps)]
    grads = {n: to_host(p.grad) for n, p in net.named_parameters()}
    return losses, grads, tr


def _case(netdef):
    (c0, hw), (x_sym, out_sym, seed) = netdef
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, c0, hw, hw)).astype(np.float32)
    y = rng.integers(0, 5, 4)
    return (lambda: minidl.Network(x_sym, out_sym, seed=seed)), x, y, (c0, hw, hw)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_networks(), st.sampled_from(MIXED), st.sampled_from(SPECS),
       st.sampled_from(["cpu", "strict"]))
def test_lossless_specs_bit_identical_within_the_precision(netdef, precision, spec, device):
    if device == "strict" and not strict.cupy_available():
        return
    make, x, y, shape = _case(netdef)
    base = _run(make, x, y, precision, "none", device)
    run = _run(make, x, y, precision, spec, device)
    assert run[0] == base[0], (spec, run[0], base[0])
    for n, g in base[1].items():
        assert np.array_equal(run[1][n], g), (spec, n)
    tr = run[2]
    tr.last_compiled.plan.validate()
    if any(flag in spec.split(",") for flag in DATA_DEPENDENT):
        return
    scratch = tr.engine.scratch.size if tr.engine.scratch is not None else None
    rep = minidl.dry_run(make(), 4, spec, input_shape=shape, precision=precision,
                         device_kind="cuda" if device == "strict" else "cpu",
                         scratch_bytes=scratch)
    assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"], spec


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_networks(), st.sampled_from(MIXED))
def test_the_device_computes_what_the_cpu_does(netdef, precision):
    """Losses within a few half roundings; gradients within a few half roundings of their
    largest entry (a float32 kernel's last bit can flip a half rounding on the device)."""
    if not strict.cupy_available():
        return
    make, x, y, _ = _case(netdef)
    cpu = _run(make, x, y, precision, "reuse,inplace", "cpu", steps=1)
    dev = _run(make, x, y, precision, "reuse,inplace", "strict", steps=1)
    eps = EPS[precision]
    np.testing.assert_allclose(dev[0], cpu[0], rtol=4 * eps)
    for n, g in cpu[1].items():
        np.testing.assert_allclose(dev[1][n], g, rtol=0, atol=8 * eps * np.abs(g).max() + 1e-7,
                                   err_msg=n)
