"""SoftmaxCrossEntropy on half logits on a device (mixed precision): the logits made float32 a
block of rows at a time in the declared workspace, the gradient computed there and rounded once
into the half gradient. On the strict device (the host path's array operations) the loss and
the gradient equal, bit for bit, those of a float32 copy of the whole logits (the gradient
rounded to the half dtype), over one block or several."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from minidl.layers.base import Context
from minidl.layers.loss import softmax_cross_entropy as sxe

strict = pytest.importorskip("minidl.memory.testing.strict_device")
pytestmark = pytest.mark.skipif(not strict.cupy_available(),
                                reason="the strict device reads CuPy's API from cupy")

from strict_mem import DeviceMem, garbage, workspace  # noqa: E402

CUDA = {"options": {"device_kind": "cuda"}}


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("block", [1 << 22, 3 * 7])  # one block; blocks of 2 rows (whole chunks)
@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16])
def test_half_logits_equal_a_float32_copy(half, block, eps, monkeypatch):
    monkeypatch.setattr(sxe, "HALF_BLOCK", block)
    monkeypatch.setattr(sxe, "_CHUNK", 2 * 7)  # forward chunks of 2 rows inside the blocks
    rng = np.random.default_rng(5)
    x = (3 * rng.standard_normal((4, 5, 7))).astype(half)
    t = rng.integers(0, 7, (4, 5))
    layer = sxe.SoftmaxCrossEntropy(label_smoothing=eps)
    shapes = [x.shape, t.shape]
    ctx = Context(training=True, options={"device_kind": "cuda"})
    # the float32 path on a float32 copy (host arrays)
    ref = sxe.SoftmaxCrossEntropy(label_smoothing=eps)
    want_loss = np.empty((), np.float32)
    x32 = x.astype(np.float32)
    ref.forward(ctx, [x32, t], [want_loss], {}, {},
                np.empty(ref.forward_workspace_bytes(shapes, np.float32), np.uint8))
    want_d = np.empty(x.shape, np.float32)
    ref.backward(ctx, [np.ones((), np.float32)], [want_d], [x32, t], [None], {}, {}, {}, None)
    # half logits on the strict device, in exactly the workspaces declared for them
    mem = DeviceMem(strict.StrictCudaDevice("64MiB"))
    xd, td = mem.put(x), mem.put(t)
    fwd = layer.forward_workspace_bytes(shapes, half, **CUDA)
    bwd = layer.backward_workspace_bytes(shapes, half, **CUDA)
    assert bwd >= 2 * 4 * min(x.size, max(block, 14))  # (two float32 blocks)
    loss = garbage(mem, (), np.float32)
    layer.forward(ctx, [xd, td], [loss], {}, {}, workspace(mem, fwd))
    d = garbage(mem, x.shape, half)
    layer.backward(ctx, [mem.put(np.ones((), np.float32))], [d], [xd, td], [None], {}, {}, {},
                   workspace(mem, bwd))
    assert mem.get(loss) == want_loss
    got = mem.get(d)
    assert got.dtype == half
    assert np.array_equal(got.view(np.uint16), want_d.astype(half).view(np.uint16))
