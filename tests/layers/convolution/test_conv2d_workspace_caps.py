"""Conv2d's ``conv_ws`` option: a cap on its declared workspace, parsed strictly, honoured by
forward and backward in exactly the declared bytes, results equal to the uncapped layer's
within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.layers import Context
from minidl.layers.convolution.conv2d import Conv2d, workspace_cap


def test_option_parsing():
    assert "conv_ws" in Conv2d.option_names
    for backward in (False, True):
        assert workspace_cap(None, backward) is None and workspace_cap({}, backward) is None
        assert workspace_cap({"conv_ws": None}, backward) is None
        assert workspace_cap({"conv_ws": 0}, backward) == 0
        assert workspace_cap({"conv_ws": np.int64(4096)}, backward) == 4096
    assert workspace_cap({"conv_ws": (512, None)}, False) == 512
    assert workspace_cap({"conv_ws": (512, None)}, True) is None
    assert workspace_cap({"conv_ws": [None, 1024]}, True) == 1024
    layer = Conv2d(8, 8, 3, padding=1)
    for bad in (-1, 1.5, "lean", True, (1, 2, 3), (None, -5)):
        with pytest.raises(ValueError, match="conv_ws"):
            layer.backward_workspace_bytes([(2, 8, 6, 6)], np.dtype(np.float32),
                                           options={"conv_ws": bad})
    shape, dt = [(4, 8, 16, 16)], np.dtype(np.float32)
    full = (layer.forward_workspace_bytes(shape, dt), layer.backward_workspace_bytes(shape, dt))
    half = {"conv_ws": (None, 0)}  # only the backward capped
    assert layer.forward_workspace_bytes(shape, dt, options=half) == full[0]
    assert layer.backward_workspace_bytes(shape, dt, options=half) < full[1]


def _run(layer, x, params, dy, options):
    """Forward and backward as the engine runs them, in workspaces of exactly the declared
    size (canaries after them must survive)."""
    dt = x.dtype
    ctx = Context(options=dict(options))
    outs = []
    for backward in (False, True):
        method = layer.backward_workspace_bytes if backward else layer.forward_workspace_bytes
        n = method([x.shape], dt, options=options)
        buf = np.full(n + 64, 0xA5, np.uint8)
        if not backward:
            y = np.full(dy.shape, np.nan, dt)
            layer.forward(ctx, [x], [y], params, {}, buf[:n])
            outs.append(y)
        else:
            dx = np.full(x.shape, np.nan, dt)
            grads = {k: np.full(v.shape, np.nan, dt) for k, v in params.items()}
            layer.backward(ctx, [dy], [dx], [x], [None], params, grads, {}, buf[:n])
            outs += [dx, grads["weight"], grads["bias"]]
        assert (buf[n:] == 0xA5).all()
    return outs


def _setup():
    layer = Conv2d(48, 64, 3, padding=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 48, 12, 12)).astype(np.float32)
    params = {k: s.initial_value(rng, np.float32) for k, s in layer.param_specs().items()}
    dy = rng.standard_normal((6, 64, 12, 12)).astype(np.float32)
    return layer, x, params, dy


def _close(got, ref):
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4 * np.abs(b).max())


def test_capped_layer_declares_less_and_computes_the_same():
    layer, x, params, dy = _setup()
    dt = np.dtype(np.float32)
    ref = _run(layer, x, params, dy, {})
    full = layer.backward_workspace_bytes([x.shape], dt, options={})
    for cap in (full // 3, 0):
        opts = {"conv_ws": cap}
        assert layer.backward_workspace_bytes([x.shape], dt, options=opts) < full
        assert layer.forward_workspace_bytes([x.shape], dt, options=opts) <= \
            layer.forward_workspace_bytes([x.shape], dt)
        _close(_run(layer, x, params, dy, opts), ref)


def test_capped_layer_on_the_strict_cuda_device():
    """The cuda kind's declared workspace under a cap, on CuPy-checked arrays in an arena
    (every NumPy call checked against CuPy's API), in exactly the declared bytes: the same
    results to rounding."""
    strict = pytest.importorskip("minidl.memory.testing.strict_device")
    if not strict.cupy_available():
        pytest.skip("the strict device reads CuPy's API from the cupy package")
    layer, x, params, dy = _setup()
    dt = np.dtype(np.float32)
    ref = _run(layer, x, params, dy, {})
    full = layer.backward_workspace_bytes([x.shape], dt, options={"device_kind": "cuda"})
    for cap in (full // 4, 0):
        opts = {"device_kind": "cuda", "conv_ws": cap}
        dev = strict.StrictCudaDevice("32MiB")
        top = [0]

        def empty(shape, dtype, dev=dev, top=top):
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            off, top[0] = top[0], top[0] + -(-max(nbytes, 1) // 512) * 512
            return dev.view(off, nbytes, tuple(shape), np.dtype(dtype))

        def put(a, empty=empty):
            d = empty(a.shape, a.dtype)
            d.set(np.ascontiguousarray(a))
            return d

        ctx = Context(options=opts)
        xd, dyd = put(x), put(dy)
        ps = {k: put(v) for k, v in params.items()}
        y, dx = empty(dy.shape, dt), empty(x.shape, dt)
        grads = {k: empty(v.shape, dt) for k, v in params.items()}
        fwd = layer.forward_workspace_bytes([x.shape], dt, options=opts)
        bwd = layer.backward_workspace_bytes([x.shape], dt, options=opts)
        assert bwd < full
        layer.forward(ctx, [xd], [y], ps, {}, empty((fwd,), np.uint8))
        layer.backward(ctx, [dyd], [dx], [xd], [None], ps, grads, {}, empty((bwd,), np.uint8))
        _close([y.get(), dx.get(), grads["weight"].get(), grads["bias"].get()], ref)
