"""Conv2d layer: declarations, finite-difference gradients, float32, PyTorch parity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds
from hypothesis import assume, given
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.convolution.conv2d import Conv2d


@st.composite
def conv_layers(draw):
    groups = draw(st.integers(1, 2))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 1)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    layer = Conv2d(cin, cout, kernel, stride, padding, dilation, groups, draw(st.booleans()))
    shape = (draw(st.integers(1, 3)), cin, draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    try:
        layer.output_shapes([shape])
    except ShapeError:
        assume(False)
    return layer, shape


@LAYER_SETTINGS
@given(case=conv_layers(), seed=seeds)
def test_gradients_float32_and_declarations(case, seed):
    layer, shape = case
    rng = np.random.default_rng(seed)
    xs = make_inputs(layer, [shape], rng)
    res = check_layer(layer, xs, rng=rng)
    assert res.outputs[0].shape == layer.output_shapes([shape])[0]


def test_declarations_and_init():
    layer = Conv2d(4, 6, (3, 2), stride=2, padding=(1, 0), groups=2)
    layer.name = "c"
    specs = layer.param_specs()
    assert specs["weight"].shape == (6, 2, 3, 2) and specs["bias"].shape == (6,)
    assert specs["weight"].fan_in == specs["bias"].fan_in == 2 * 3 * 2
    w = specs["weight"].initial_value(np.random.default_rng(0))
    assert np.abs(w).max() <= 1 / math.sqrt(12) and np.abs(w).max() > 0.5 / math.sqrt(12)
    assert "bias" not in Conv2d(1, 2, 3, bias=False).param_specs()
    assert layer.output_shapes([(5, 4, 9, 7)]) == [(5, 6, 5, 3)]
    assert layer.flops([(5, 4, 9, 7)]) == 2 * 5 * 6 * 5 * 3 * 2 * 3 * 2
    assert layer.kind == "conv" and layer.retain_inputs == (0,) and layer.retain_outputs == ()
    for dt in (np.float32, np.float64):
        assert layer.forward_workspace_bytes([(5, 4, 9, 7)], np.dtype(dt)) > 0
        assert layer.backward_workspace_bytes([(5, 4, 9, 7)], np.dtype(dt)) > 0
    assert repr(layer) == ("Conv2d(4, 6, kernel_size=(3, 2), stride=(2, 2), padding=(1, 0), "
                           "groups=2)")


def test_shape_errors_name_layer_and_shapes():
    layer = Conv2d(3, 8, 5)
    layer.name = "conv_a"
    with pytest.raises(ShapeError, match=r"conv_a.*\(N, 3, H, W\).*\(2, 4, 9, 9\)"):
        layer.output_shapes([(2, 4, 9, 9)])
    with pytest.raises(ShapeError, match=r"conv_a.*\(3, 9, 9\)"):
        layer.output_shapes([(3, 9, 9)])
    with pytest.raises(ShapeError, match=r"conv_a.*positive output.*\(2, 3, 4, 9\)"):
        layer.output_shapes([(2, 3, 4, 9)])
    with pytest.raises(ValueError, match="divisible by groups"):
        Conv2d(3, 4, 3, groups=2)
    with pytest.raises(ValueError, match="kernel_size"):
        Conv2d(3, 4, (3, 0))
    with pytest.raises(ValueError, match="padding"):
        Conv2d(3, 4, 3, padding=-1)


def test_no_input_gradient_when_not_needed():
    layer = Conv2d(1, 4, 3, padding=1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 5, 5))
    params = {k: s.initial_value(rng, np.float64) for k, s in layer.param_specs().items()}
    g = [rng.standard_normal((2, 4, 5, 5))]
    full = forward_backward(layer, Context(), [x], params, g)
    none = forward_backward(layer, Context(), [x], params, g, need_grads=[False])
    assert none.grad_inputs == [None]
    for k in full.grad_params:
        np.testing.assert_array_equal(none.grad_params[k], full.grad_params[k])


CASES = [
    dict(cin=1, cout=32, k=3, stride=1, padding=1, dilation=1, groups=1, bias=True, hw=(28, 28)),
    dict(cin=32, cout=64, k=3, stride=1, padding=1, dilation=1, groups=1, bias=True, hw=(14, 14)),
    dict(cin=6, cout=4, k=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2,
         bias=False, hw=(11, 9)),
    dict(cin=4, cout=8, k=5, stride=2, padding=2, dilation=1, groups=4, bias=True, hw=(9, 10)),
]


@pytest.mark.parametrize("c", CASES)
def test_matches_torch_float32(c):
    torch = pytest.importorskip("torch")
    layer = Conv2d(c["cin"], c["cout"], c["k"], c["stride"], c["padding"], c["dilation"],
                   c["groups"], c["bias"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, c["cin"], *c["hw"])).astype(np.float32)
    params = {k: s.initial_value(rng, np.float32) for k, s in layer.param_specs().items()}
    dy = rng.standard_normal(layer.output_shapes([x.shape])[0]).astype(np.float32)
    res = forward_backward(layer, Context(), [x], params, [dy])

    tl = torch.nn.Conv2d(c["cin"], c["cout"], c["k"], c["stride"], c["padding"],
                         c["dilation"], c["groups"], c["bias"])
    with torch.no_grad():
        tl.weight.copy_(torch.from_numpy(params["weight"]))
        if c["bias"]:
            tl.bias.copy_(torch.from_numpy(params["bias"]))
    xt = torch.from_numpy(x).requires_grad_()
    yt = tl(xt)
    yt.backward(torch.from_numpy(dy))

    def close(a, b):
        b = b.detach().numpy()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(b).max()))

    close(res.outputs[0], yt)
    close(res.grad_inputs[0], xt.grad)
    close(res.grad_params["weight"], tl.weight.grad)
    if c["bias"]:
        close(res.grad_params["bias"], tl.bias.grad)
