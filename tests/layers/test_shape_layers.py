"""Flatten, Add, Concat, GlobalAvgPool2d: gradients, values, shape errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds, shapes
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.add import Add
from minidl.layers.concat import Concat
from minidl.layers.flatten import Flatten
from minidl.layers.pooling.global_avg_pool import GlobalAvgPool2d


@LAYER_SETTINGS
@given(shape=shapes(2, 5), data=st.data(), seed=seeds)
def test_flatten(shape, data, seed):
    r = len(shape)
    start = data.draw(st.integers(1, r - 1))
    end = data.draw(st.integers(start, r - 1))
    if data.draw(st.booleans()):
        end -= r
    rng = np.random.default_rng(seed)
    layer = Flatten(start, end)
    xs = make_inputs(layer, [shape], rng)
    res = check_layer(layer, xs, rng=rng)
    want = xs[0].reshape(*shape[:start], -1, *shape[(end % r) + 1:])
    np.testing.assert_array_equal(res.outputs[0], want)


def test_flatten_default_and_errors():
    assert Flatten().output_shapes([(8, 3, 4, 5)]) == [(8, 60)]
    assert Flatten().describe() == "Flatten()"
    with pytest.raises(ValueError):
        Flatten(0)
    with pytest.raises(ShapeError):
        Flatten(-3).output_shapes([(2, 3)])  # resolves to the batch axis
    with pytest.raises(ShapeError):
        Flatten(2).output_shapes([(2, 3)])


@LAYER_SETTINGS
@given(shape=shapes(1, 4), k=st.integers(2, 4), seed=seeds)
def test_add(shape, k, seed):
    rng = np.random.default_rng(seed)
    layer = Add()
    xs = make_inputs(layer, [shape] * k, rng)
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_allclose(res.outputs[0], sum(xs), rtol=1e-15)


def test_add_errors():
    layer = Add()
    layer.name = "res1"
    with pytest.raises(ShapeError, match=r"res1.*\(2, 3\).*\(2, 4\)"):
        layer.output_shapes([(2, 3), (2, 4)])
    with pytest.raises(TypeError):
        layer.output_shapes([(2, 3)])
    with pytest.raises(TypeError):
        layer.output_dtypes([np.float32, np.float64])


@LAYER_SETTINGS
@given(base=shapes(2, 4), sizes=st.lists(st.integers(1, 4), min_size=2, max_size=4),
       data=st.data(), seed=seeds)
def test_concat(base, sizes, data, seed):
    r = len(base)
    axis = data.draw(st.integers(1, r - 1))
    if data.draw(st.booleans()):
        axis -= r
    in_shapes = []
    for s in sizes:
        t = list(base)
        t[axis] = s
        in_shapes.append(tuple(t))
    rng = np.random.default_rng(seed)
    layer = Concat(axis)
    xs = make_inputs(layer, in_shapes, rng)
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_array_equal(res.outputs[0], np.concatenate(xs, axis=axis))
    # some gradients not needed: the others still land in the right slices
    need = [i % 2 == 1 for i in range(len(xs))]
    g = rng.standard_normal(res.outputs[0].shape)
    part = forward_backward(layer, Context(), xs, {}, [g], need_grads=need)
    full = np.split(g, np.cumsum([x.shape[axis] for x in xs])[:-1], axis=axis)
    for i, gi in enumerate(part.grad_inputs):
        if need[i]:
            np.testing.assert_array_equal(gi, full[i])
        else:
            assert gi is None


def test_concat_errors():
    layer = Concat(1)
    layer.name = "cat"
    with pytest.raises(ShapeError, match=r"cat.*\(2, 3, 4\).*\(2, 3, 5\)"):
        layer.output_shapes([(2, 3, 4), (2, 3, 5)])
    with pytest.raises(ShapeError):
        layer.output_shapes([(2, 3), (2, 3, 1)])
    with pytest.raises(ShapeError):
        Concat(3).output_shapes([(2, 3, 4), (2, 3, 4)])
    with pytest.raises(ValueError):
        Concat(0)
    with pytest.raises(TypeError):
        layer.output_shapes([(2, 3)])
    assert layer.output_shapes([(2, 3, 4), (2, 5, 4)]) == [(2, 8, 4)]


@LAYER_SETTINGS
@given(shape=shapes(4, 4), seed=seeds)
def test_global_avg_pool(shape, seed):
    rng = np.random.default_rng(seed)
    layer = GlobalAvgPool2d()
    xs = make_inputs(layer, [shape], rng)
    res = check_layer(layer, xs, rng=rng)
    np.testing.assert_allclose(res.outputs[0], xs[0].mean(axis=(2, 3)), rtol=1e-13)


def test_global_avg_pool_shapes():
    assert GlobalAvgPool2d().output_shapes([(8, 512, 7, 7)]) == [(8, 512)]
    with pytest.raises(ShapeError):
        GlobalAvgPool2d().output_shapes([(8, 512)])
