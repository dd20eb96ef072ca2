"""Dropout: seeded replayable mask, inverted scaling, eval identity, rate, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds, shapes
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context
from minidl.layers.dropout import Dropout


@LAYER_SETTINGS
@given(shape=shapes(1, 4), p=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]), seed=seeds,
       training=st.booleans())
def test_dropout(shape, p, seed, training):
    rng = np.random.default_rng(seed)
    layer = Dropout(p)
    xs = make_inputs(layer, [shape], rng)
    ctx = Context(training=training, seed=seed)
    res = check_layer(layer, xs, rng=rng, ctx=ctx)
    mask = res.stash["mask"]
    assert mask.dtype == np.uint8 and mask.shape == shape
    if not training or p == 0:
        np.testing.assert_array_equal(res.outputs[0], xs[0])
    elif p == 1:
        assert not res.outputs[0].any()
    else:
        np.testing.assert_allclose(res.outputs[0], xs[0] * mask / (1 - p), rtol=1e-15)


def test_same_seed_same_mask_other_seed_other_mask():
    x = np.ones((64, 64), dtype=np.float32)
    layer = Dropout(0.5)
    a = forward_backward(layer, Context(seed=7), [x], {}).stash["mask"]
    b = forward_backward(layer, Context(seed=7, recomputing=True), [x], {}).stash["mask"]
    c = forward_backward(layer, Context(seed=8), [x], {}).stash["mask"]
    d = forward_backward(layer, Context(seed=7), [x.astype(np.float64)], {}).stash["mask"]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, d)  # the mask does not depend on the dtype
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_rate_and_scale(p):
    x = np.ones((300, 400))  # 120000 elements: more than one chunk of draws
    res = forward_backward(Dropout(p), Context(seed=11), [x], {}, [np.ones_like(x)])
    kept = res.stash["mask"].mean()
    assert abs(kept - (1 - p)) < 0.01
    assert set(np.unique(res.outputs[0])) <= {0.0, 1 / (1 - p)}
    np.testing.assert_array_equal(res.grad_inputs[0], res.outputs[0])


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_bad_p(p):
    with pytest.raises(ValueError):
        Dropout(p)


def test_declarations():
    layer = Dropout(0.25)
    assert layer.describe() == "Dropout(p=0.25)" and layer.kind == "dropout"
    assert layer.retain_inputs == () and layer.retain_outputs == ()
    assert layer.stash_specs([(2, 3)], np.dtype(np.float32)) == {"mask": ((2, 3), np.uint8)}
