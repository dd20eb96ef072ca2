"""Linear: gradients, shapes, flops, initialisation bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, make_inputs, seeds
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import ShapeError
from minidl.layers.linear import Linear


@LAYER_SETTINGS
@given(n=st.integers(1, 5), mid=st.lists(st.integers(1, 3), max_size=2),
       fin=st.integers(1, 6), fout=st.integers(1, 6), bias=st.booleans(), seed=seeds)
def test_linear(n, mid, fin, fout, bias, seed):
    rng = np.random.default_rng(seed)
    layer = Linear(fin, fout, bias=bias)
    shape = (n, *mid, fin)
    xs = make_inputs(layer, [shape], rng)
    params = {k: rng.standard_normal(s.shape) for k, s in layer.param_specs().items()}
    res = check_layer(layer, xs, params, rng=rng)
    want = xs[0] @ params["weight"].T + (params["bias"] if bias else 0)
    np.testing.assert_allclose(res.outputs[0], want, rtol=1e-12, atol=1e-12)
    assert layer.flops([shape]) == 2 * math.prod(shape[:-1]) * fin * fout


def test_linear_declarations_and_init():
    layer = Linear(784, 10)
    assert layer.describe() == "Linear(784, 10)"
    assert Linear(3, 2, bias=False).describe() == "Linear(3, 2, bias=False)"
    specs = layer.param_specs()
    assert specs["weight"].shape == (10, 784) and specs["bias"].shape == (10,)
    w = specs["weight"].initial_value(np.random.default_rng(0), np.float64)
    bound = 1 / math.sqrt(784)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
    assert specs["bias"].fan_in == 784
    assert layer.retain_inputs == (0,) and layer.retain_outputs == ()
    assert layer.output_shapes([(32, 784)]) == [(32, 10)]


@pytest.mark.parametrize("shape", [(4, 783), (784,), (2, 3, 5)])
def test_linear_shape_error(shape):
    with pytest.raises(ShapeError, match=r"Linear\(784, 10\).*784.*" + str(shape[-1])):
        Linear(784, 10).output_shapes([shape])


def test_linear_shape_error_names_layer():
    layer = Linear(4, 2)
    layer.name = "fc1"
    with pytest.raises(ShapeError, match="fc1"):
        layer.output_shapes([(3, 5)])
