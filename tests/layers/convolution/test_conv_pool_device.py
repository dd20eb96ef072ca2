"""Conv2d, AvgPool2d, MaxPool2d and GlobalAvgPool2d on device arrays: the workspace each
declares per device kind, and one engine-like forward and backward on the strict CUDA test
device (CuPy-checked arrays in an arena) against the same layer on NumPy arrays.

On the device, every output, gradient and workspace starts as garbage (NaN / 0xFF), the
workspace has exactly the size the layer declares for ``"cuda"``, and nothing may be created
outside them (CuPy's own pool stays empty)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minidl.kernels.convolution.conv import conv2d_workspace_bytes
from minidl.kernels.convolution.conv_device import conv2d_device_workspace_bytes
from minidl.layers import Context
from minidl.layers.convolution.conv2d import Conv2d
from minidl.layers.pooling.global_avg_pool import GlobalAvgPool2d
from minidl.layers.pooling.pool import AvgPool2d, MaxPool2d

CUDA = {"device_kind": "cuda"}


def test_conv2d_declares_its_workspace_per_device_kind():
    layer = Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), groups=2)
    shape, dt = (5, 4, 9, 7), np.dtype(np.float32)
    assert "device_kind" in layer.option_names
    assert layer.stash_specs([shape], dt, options=CUDA) == {}
    geom = (6, (3, 2), (2, 2), (1, 0), (1, 1), 2, dt)
    for backward, method in ((False, layer.forward_workspace_bytes),
                             (True, layer.backward_workspace_bytes)):
        cpu = conv2d_workspace_bytes(shape, *geom, backward)
        assert method([shape], dt) == cpu
        assert method([shape], dt, options={}) == cpu
        assert method([shape], dt, options={"device_kind": "cpu"}) == cpu
        assert method([shape], dt, options=CUDA) == conv2d_device_workspace_bytes(
            shape, *geom, backward) > 0
    with pytest.raises(ValueError, match="device kind"):
        layer.forward_workspace_bytes([shape], dt, options={"device_kind": "tpu"})


def test_pooling_workspaces():
    """Pooling needs none, but global average pooling on the GPU (a column of 1/(H*W))."""
    dt = np.dtype(np.float32)
    for layer in (AvgPool2d(3, 2, 1), MaxPool2d(2)):
        for method in (layer.forward_workspace_bytes, layer.backward_workspace_bytes):
            assert method([(2, 3, 8, 8)], dt) == 0
    gap = GlobalAvgPool2d()
    assert "device_kind" in gap.option_names
    assert gap.stash_specs([(2, 3, 8, 7)], dt, options=CUDA) == {}
    assert gap.forward_workspace_bytes([(2, 3, 8, 7)], dt) == 0
    assert gap.forward_workspace_bytes([(2, 3, 8, 7)], dt, options={"device_kind": "cpu"}) == 0
    assert gap.forward_workspace_bytes([(2, 3, 8, 7)], dt, options=CUDA) >= 8 * 7 * 4
    assert gap.backward_workspace_bytes([(2, 3, 8, 7)], dt, options=CUDA) == 0


# ---------------------------------------------------------------- the strict device
strict = pytest.importorskip("minidl.memory.testing.strict_device")
if not strict.cupy_available():
    pytest.skip("the strict device reads CuPy's API from the cupy package",
                allow_module_level=True)

ALIGN = 512


@pytest.fixture
def dev():
    return strict.StrictCudaDevice("32MiB")


class Mem:
    """Arrays for one run: NumPy ones, or views of the strict device's arena."""

    def __init__(self, dev=None) -> None:
        self.dev, self.offset = dev, 0

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        if self.dev is None:
            return np.empty(shape, dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        off, self.offset = self.offset, self.offset + -(-max(nbytes, 1) // ALIGN) * ALIGN
        return self.dev.view(off, nbytes, tuple(shape), dtype)

    def put(self, host: np.ndarray):
        a = self.empty(host.shape, host.dtype)
        if self.dev is None:
            a[...] = host
        else:
            a.set(np.ascontiguousarray(host))
        return a

    def get(self, a) -> np.ndarray:
        return np.array(a, copy=True) if self.dev is None else a.get()

    def garbage(self, shape, dtype):
        a = self.empty(shape, dtype)
        a.fill(np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).max)
        return a

    def workspace(self, nbytes: int):
        ws = self.empty((nbytes,), np.uint8)
        ws.fill(0xFF)
        return ws


def step(layer, mem: Mem, x: np.ndarray, params: dict, dy: np.ndarray, *, accumulate=(),
         grad_init=None, need_dx: bool = True) -> dict[str, np.ndarray]:
    """Forward then backward as the engine runs them, with the workspaces declared for the
    memory's device kind; every result copied to the host."""
    opts = {"options": CUDA if mem.dev is not None else {}} if layer.option_names else {}
    ctx = Context(training=True, accumulate=frozenset(accumulate),
                  options=opts.get("options", {}))
    shapes, dt = [x.shape], x.dtype
    xd = mem.put(x)
    ps = {k: mem.put(v) for k, v in params.items()}
    y = mem.garbage(layer.output_shapes(shapes)[0], dt)
    stash = {k: mem.garbage(s, d) for k, (s, d) in layer.stash_specs(shapes, dt,
                                                                      **opts).items()}
    layer.forward(ctx, [xd], [y], ps, stash,
                  mem.workspace(layer.forward_workspace_bytes(shapes, dt, **opts)))
    out = {"y": mem.get(y), **{f"stash.{k}": mem.get(v) for k, v in stash.items()}}
    kept = xd if layer.retain_inputs else None
    if kept is None:
        xd.fill(np.nan)  # the engine may reuse an input backward does not retain
    y.fill(np.nan)
    dx = mem.garbage(x.shape, dt) if need_dx else None
    grads = {k: mem.put(grad_init[k]) if k in accumulate else mem.garbage(v.shape, dt)
             for k, v in params.items()}
    layer.backward(ctx, [mem.put(dy)], [dx], [kept], [None], ps, grads, stash,
                   mem.workspace(layer.backward_workspace_bytes(shapes, dt, **opts)))
    if need_dx:
        out["dx"] = mem.get(dx)
    out.update({f"grad.{k}": mem.get(v) for k, v in grads.items()})
    return out


def compare(dev, layer, x, params=None, *, exact=False, **kw) -> None:
    params = params or {}
    rng = np.random.default_rng(1)
    dy = rng.standard_normal(layer.output_shapes([x.shape])[0]).astype(x.dtype)
    calls = dev.checked_calls
    got = step(layer, Mem(dev), x, params, dy, **kw)
    assert dev.checked_calls > calls  # the device ran the layer
    assert dev.default_pool_peak == 0  # and created no array outside outputs and workspace
    want = step(layer, Mem(), x, params, dy, **kw)
    assert got.keys() == want.keys()
    tol = 1e-12 if x.dtype == np.float64 else 1e-5
    for k, w in want.items():
        if exact:
            np.testing.assert_array_equal(got[k], w, err_msg=k)
        else:
            np.testing.assert_allclose(got[k], w, rtol=tol, atol=tol * np.abs(w).max(),
                                       err_msg=k)


CONV_CASES = {
    "3x3-pad": (Conv2d(3, 8, 3, padding=1), (4, 3, 10, 9)),
    "groups-stride-dilation": (Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(2, 1),
                                      dilation=(1, 2), groups=2), (3, 4, 11, 8)),
    "1x1-no-bias": (Conv2d(5, 4, 1, bias=False), (2, 5, 6, 6)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CONV_CASES)
@pytest.mark.parametrize("accumulate", [(), ("weight", "bias"), ("weight",), ("bias",)])
def test_conv2d_on_the_strict_device(dev, name, dtype, accumulate):
    layer, shape = CONV_CASES[name]
    rng = np.random.default_rng(0)
    params = {k: spec.initial_value(rng, dtype) for k, spec in layer.param_specs().items()}
    init = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in params.items()}
    x = rng.standard_normal(shape).astype(dtype)
    compare(dev, layer, x, params, accumulate=[a for a in accumulate if a in params],
            grad_init=init, need_dx=not accumulate)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layer", [AvgPool2d(3, 2, 1), AvgPool2d((2, 3), (1, 2)),
                                   MaxPool2d(2), MaxPool2d(3, 2, 1), GlobalAvgPool2d()],
                         ids=repr)
@pytest.mark.parametrize("shape", [(3, 4, 9, 8), (1, 1, 5, 6)])
def test_pooling_on_the_strict_device(dev, layer, dtype, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    # max pooling runs the same (CUDA) kernel code on both: bit-identical
    compare(dev, layer, x, exact=isinstance(layer, MaxPool2d))
