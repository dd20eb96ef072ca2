"""LeakyReLU, Sigmoid, Tanh: gradients, in place, values, extreme inputs."""

from __future__ import annotations

import numpy as np
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds, shapes
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context
from minidl.layers.activation.leaky_relu import LeakyReLU
from minidl.layers.activation.sigmoid import Sigmoid
from minidl.layers.activation.tanh import Tanh


@LAYER_SETTINGS
@given(shape=shapes(1, 4), slope=st.floats(-2.0, 2.0), seed=seeds)
def test_leaky_relu(shape, slope, seed):
    rng = np.random.default_rng(seed)
    layer = LeakyReLU(slope)
    xs = make_inputs(layer, [shape], rng, kinks=(0.0,))
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_allclose(res.outputs[0], np.where(xs[0] > 0, xs[0], slope * xs[0]))
    if slope >= 0:
        assert layer.retain_outputs == (0,) and layer.inplace_forward
    else:
        assert layer.retain_inputs == (0,) and not layer.inplace_forward


def test_leaky_relu_declarations():
    assert LeakyReLU().describe() == "LeakyReLU(0.01)"
    assert LeakyReLU().negative_slope == 0.01
    # a negative slope changes only that instance
    LeakyReLU(-1.0)
    assert LeakyReLU.retain_outputs == (0,) and LeakyReLU.retain_inputs == ()


@LAYER_SETTINGS
@given(shape=shapes(1, 4), seed=seeds, which=st.sampled_from(["sigmoid", "tanh"]))
def test_sigmoid_tanh(shape, seed, which):
    rng = np.random.default_rng(seed)
    layer = Sigmoid() if which == "sigmoid" else Tanh()
    xs = make_inputs(layer, [shape], rng)
    xs[0] *= 3
    res = check_layer(layer, xs, rng=rng)
    want = 1 / (1 + np.exp(-xs[0])) if which == "sigmoid" else np.tanh(xs[0])
    np.testing.assert_allclose(res.outputs[0], want, rtol=1e-12, atol=1e-15)


def test_sigmoid_extremes_no_warnings():
    x = np.array([[-1000.0, -50.0, 0.0, 50.0, 1000.0]], dtype=np.float32)
    with np.errstate(all="raise"):
        r = forward_backward(Sigmoid(), Context(), [x], {}, [np.ones_like(x)])
    y = r.outputs[0]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, [[0.0, 1.9287499e-22, 0.5, 1.0, 1.0]], rtol=1e-6)
    assert np.all(np.isfinite(r.grad_inputs[0]))


def test_non_contiguous_falls_back_to_reference():
    """The kernels' NumPy path (non-contiguous views) gives the same result."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((6, 8))
    for layer in (LeakyReLU(0.2), Sigmoid(), Tanh()):
        x = big[:, ::2]
        y = np.empty((6, 4))
        layer.forward(Context(), [x], [y], {}, {}, None)
        out = np.empty((6, 8))[:, ::2]
        layer.forward(Context(), [x], [out], {}, {}, None)
        np.testing.assert_allclose(out, y, rtol=1e-15)
        dy = big[::-1, 1::2]
        ref = np.empty((6, 4))
        args = ([x], [y]) if layer.retain_inputs else ([None], [y])
        layer.backward(Context(), [np.ascontiguousarray(dy)], [ref], *args, {}, {}, {}, None)
        got = np.empty((6, 8))[:, 1::2]
        layer.backward(Context(), [dy], [got], *args, {}, {}, {}, None)
        np.testing.assert_allclose(got, ref, rtol=1e-15)
