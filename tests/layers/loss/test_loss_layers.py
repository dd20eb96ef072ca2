"""SoftmaxCrossEntropy and MSELoss: gradients, values, label smoothing, errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds, shapes
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.loss.mse_loss import MSELoss
from minidl.layers.loss.softmax_cross_entropy import SoftmaxCrossEntropy


def _reference_ce(x, t, eps):
    k = x.shape[-1]
    x2, t2 = x.reshape(-1, k), t.reshape(-1)
    logp = x2 - x2.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    q = np.full_like(logp, eps / k)
    q[np.arange(len(t2)), t2] += 1 - eps
    return -(q * logp).sum() / len(t2)


@LAYER_SETTINGS
@given(lead=shapes(1, 2), k=st.integers(1, 6), eps=st.sampled_from([0.0, 0.1, 0.5]),
       seed=seeds)
def test_softmax_cross_entropy(lead, k, eps, seed):
    rng = np.random.default_rng(seed)
    layer = SoftmaxCrossEntropy(label_smoothing=eps)
    xs = make_inputs(layer, [(*lead, k), lead], rng, int_inputs={1: k})
    xs[0] *= 3
    res = check_layer(layer, xs, rng=rng)
    assert res.outputs[0].shape == ()
    np.testing.assert_allclose(res.outputs[0], _reference_ce(xs[0], xs[1], eps), rtol=1e-12)
    assert res.grad_inputs[1] is None


def test_cross_entropy_large_logits_and_chunks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 500)) * 1000  # many chunks; exp would overflow naively
    t = rng.integers(0, 500, 300)
    res = forward_backward(SoftmaxCrossEntropy(0.2), Context(), [x, t], {}, [np.array(1.0)])
    np.testing.assert_allclose(res.outputs[0], _reference_ce(x, t, 0.2), rtol=1e-12)
    assert np.all(np.isfinite(res.grad_inputs[0]))
    np.testing.assert_allclose(res.grad_inputs[0].sum(axis=1), 0, atol=1e-15)


def test_cross_entropy_errors():
    layer = SoftmaxCrossEntropy()
    layer.name = "ce"
    with pytest.raises(IndexError, match=r"ce.*target 7.*5 classes"):
        forward_backward(layer, Context(), [np.zeros((2, 5)), np.array([1, 7])], {})
    with pytest.raises(IndexError, match="target -1"):
        forward_backward(layer, Context(), [np.zeros((2, 5)), np.array([-1, 0])], {})
    with pytest.raises(TypeError):
        layer.output_dtypes([np.float32, np.float32])
    with pytest.raises(ShapeError, match="ce"):
        layer.output_shapes([(4, 5), (3,)])
    with pytest.raises(ShapeError):
        layer.output_shapes([(4,), (4,)])
    with pytest.raises(ValueError):
        SoftmaxCrossEntropy(label_smoothing=1.5)
    assert layer.output_shapes([(2, 7, 11), (2, 7)]) == [()]
    assert SoftmaxCrossEntropy(0.1).describe() == "SoftmaxCrossEntropy(label_smoothing=0.1)"


@LAYER_SETTINGS
@given(shape=shapes(1, 4), seed=seeds)
def test_mse(shape, seed):
    rng = np.random.default_rng(seed)
    layer = MSELoss()
    xs = make_inputs(layer, [shape, shape], rng)
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_allclose(res.outputs[0], np.mean((xs[0] - xs[1]) ** 2), rtol=1e-12)
    assert res.grad_inputs[1] is None


def test_mse_many_chunks_and_errors():
    rng = np.random.default_rng(0)
    p, t = rng.standard_normal((2, 100_000)), rng.standard_normal((2, 100_000))
    res = forward_backward(MSELoss(), Context(), [p, t], {}, [np.array(0.5)])
    np.testing.assert_allclose(res.outputs[0], np.mean((p - t) ** 2), rtol=1e-12)
    np.testing.assert_allclose(res.grad_inputs[0], (p - t) / p.size, rtol=1e-12)
    with pytest.raises(ShapeError):
        MSELoss().output_shapes([(2, 3), (2, 4)])
