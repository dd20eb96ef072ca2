"""Forward and backward against PyTorch (skipped when torch is not importable)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import forward_backward

from minidl.layers import Context
from minidl.layers.activation.leaky_relu import LeakyReLU
from minidl.layers.linear import Linear
from minidl.layers.loss.mse_loss import MSELoss
from minidl.layers.loss.softmax_cross_entropy import SoftmaxCrossEntropy
from minidl.layers.normalization.batchnorm import BatchNorm1d, BatchNorm2d
from minidl.layers.pooling.global_avg_pool import GlobalAvgPool2d
from minidl.layers.transformer.embedding import Embedding

torch = pytest.importorskip("torch")


def _t(a, grad=False):
    return torch.tensor(np.asarray(a), requires_grad=grad)


def _close(a, b, tol=1e-10):
    np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=tol, atol=tol)


def test_linear():
    rng = np.random.default_rng(0)
    layer = Linear(7, 4)
    tl = torch.nn.Linear(7, 4).double()
    params = {"weight": tl.weight.detach().numpy().copy(), "bias": tl.bias.detach().numpy().copy()}
    x = rng.standard_normal((5, 3, 7))
    g = rng.standard_normal((5, 3, 4))
    res = forward_backward(layer, Context(), [x], params, [g])
    xt = _t(x, True)
    yt = tl(xt)
    yt.backward(_t(g))
    _close(res.outputs[0], yt)
    _close(res.grad_inputs[0], xt.grad)
    _close(res.grad_params["weight"], tl.weight.grad)
    _close(res.grad_params["bias"], tl.bias.grad)


@pytest.mark.parametrize("momentum", [0.2, None])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls,tcls,shape", [(BatchNorm2d, "BatchNorm2d", (4, 3, 5, 6)),
                                            (BatchNorm1d, "BatchNorm1d", (6, 3)),
                                            (BatchNorm1d, "BatchNorm1d", (4, 3, 5))])
def test_batchnorm(training, cls, tcls, shape, momentum):
    rng = np.random.default_rng(1)
    layer = cls(3, momentum=momentum)
    tb = getattr(torch.nn, tcls)(3, momentum=momentum).double()
    with torch.no_grad():
        tb.weight.copy_(_t(rng.uniform(0.5, 2, 3)))
        tb.bias.copy_(_t(rng.standard_normal(3)))
        tb.running_mean.copy_(_t(rng.standard_normal(3)))
        tb.running_var.copy_(_t(rng.uniform(0.5, 2, 3)))
        tb.num_batches_tracked.fill_(3)  # with momentum=None the next update weighs 1/4
    params = {k: v.detach().numpy().copy() for k, v in tb.state_dict().items()}
    assert set(params) == set(layer.param_specs())
    tb.train(training)
    x = rng.standard_normal(shape) * 2 + 1
    g = rng.standard_normal(shape)
    res = forward_backward(layer, Context(training=training), [x], params, [g])
    xt = _t(x, True)
    yt = tb(xt)
    yt.backward(_t(g))
    _close(res.outputs[0], yt)
    _close(res.grad_inputs[0], xt.grad)
    _close(res.grad_params["weight"], tb.weight.grad)
    _close(res.grad_params["bias"], tb.bias.grad)
    _close(res.params_after["running_mean"], tb.running_mean)
    _close(res.params_after["running_var"], tb.running_var)
    assert res.params_after["num_batches_tracked"].dtype == np.int64
    assert int(res.params_after["num_batches_tracked"]) == int(tb.num_batches_tracked)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(6, 5), (2, 4, 7)])
def test_softmax_cross_entropy(eps, shape):
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape) * 4
    t = rng.integers(0, shape[-1], shape[:-1])
    res = forward_backward(SoftmaxCrossEntropy(eps), Context(), [x, t], {}, [np.array(0.7)])
    xt = _t(x, True)
    loss = torch.nn.functional.cross_entropy(
        xt.reshape(-1, shape[-1]), _t(t).reshape(-1), label_smoothing=eps
    )
    (loss * 0.7).backward()
    _close(res.outputs[0], loss)
    _close(res.grad_inputs[0], xt.grad)


def test_mse_embedding_leaky_gap():
    rng = np.random.default_rng(3)
    p, q = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    res = forward_backward(MSELoss(), Context(), [p, q], {}, [np.array(1.0)])
    pt = _t(p, True)
    loss = torch.nn.functional.mse_loss(pt, _t(q))
    loss.backward()
    _close(res.outputs[0], loss)
    _close(res.grad_inputs[0], pt.grad)

    te = torch.nn.Embedding(10, 3).double()
    idx = rng.integers(0, 10, (4, 6))
    g = rng.standard_normal((4, 6, 3))
    res = forward_backward(Embedding(10, 3, dtype=np.float64), Context(), [idx],
                           {"weight": te.weight.detach().numpy().copy()}, [g])
    te(_t(idx)).backward(_t(g))
    _close(res.grad_params["weight"], te.weight.grad)

    x = rng.standard_normal((3, 4, 5, 6))
    g = rng.standard_normal((3, 4))
    res = forward_backward(GlobalAvgPool2d(), Context(), [x], {}, [g])
    xt = _t(x, True)
    yt = torch.nn.AdaptiveAvgPool2d(1)(xt).flatten(1)
    yt.backward(_t(g))
    _close(res.outputs[0], yt)
    _close(res.grad_inputs[0], xt.grad)

    x = rng.standard_normal((3, 8))
    res = forward_backward(LeakyReLU(0.2), Context(), [x], {}, [np.ones_like(x)])
    xt = _t(x, True)
    torch.nn.functional.leaky_relu(xt, 0.2).sum().backward()
    _close(res.grad_inputs[0], xt.grad)
