"""ReLU against the contract: kink-aware gradients, in place, float32."""

from __future__ import annotations

import numpy as np
from gradcheck import LAYER_SETTINGS, check_layer, make_inputs, seeds, shapes
from hypothesis import given

from minidl.layers import ReLU


@LAYER_SETTINGS
@given(shape=shapes(1, 4), seed=seeds)
def test_relu(shape, seed):
    rng = np.random.default_rng(seed)
    layer = ReLU()
    xs = make_inputs(layer, [shape], rng, kinks=(0.0,))
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_array_equal(res.outputs[0], np.maximum(xs[0], 0))


def test_relu_declarations():
    layer = ReLU()
    assert layer.kind == "relu" and layer.retain_outputs == (0,) and layer.retain_inputs == ()
    assert layer.output_shapes([(2, 3)]) == [(2, 3)]
