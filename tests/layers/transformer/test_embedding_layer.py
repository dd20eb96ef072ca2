"""Embedding: gradients (scatter-add with repeated indices), dtype, index errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds, shapes
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context
from minidl.layers.transformer.embedding import Embedding


@LAYER_SETTINGS
@given(shape=shapes(1, 3), num=st.integers(1, 8), dim=st.integers(1, 5), seed=seeds)
def test_embedding(shape, num, dim, seed):
    rng = np.random.default_rng(seed)
    layer = Embedding(num, dim, dtype=np.float64)
    xs = make_inputs(layer, [shape], rng, int_inputs={0: num})
    params = {"weight": rng.standard_normal((num, dim))}
    res = check_layer(layer, xs, params, rng=rng, float32=False)
    np.testing.assert_array_equal(res.outputs[0], params["weight"][xs[0]])
    assert res.grad_inputs == [None]


def test_repeated_indices_accumulate_and_unused_rows_are_zero():
    layer = Embedding(5, 2)
    w = np.arange(10, dtype=np.float32).reshape(5, 2)
    idx = np.array([[1, 1, 3]])
    g = np.ones((1, 3, 2), dtype=np.float32)
    res = forward_backward(layer, Context(), [idx], {"weight": w}, [g])
    assert res.outputs[0].dtype == np.float32
    np.testing.assert_array_equal(res.grad_params["weight"],
                                  [[0, 0], [2, 2], [0, 0], [1, 1], [0, 0]])


@pytest.mark.parametrize("bad", [5, -1])
def test_out_of_range(bad):
    layer = Embedding(5, 2)
    layer.name = "tok"
    w = np.zeros((5, 2), dtype=np.float32)
    with pytest.raises(IndexError, match=rf"tok.*index {bad}.*size 5"):
        forward_backward(layer, Context(), [np.array([[0, bad]])], {"weight": w})


def test_float_indices_refused():
    layer = Embedding(5, 2)
    with pytest.raises(TypeError, match="integer"):
        layer.output_dtypes([np.float32])
    with pytest.raises(TypeError, match="integer"):
        forward_backward(layer, Context(), [np.zeros((2, 3))], {"weight": np.zeros((5, 2))})


def test_declarations():
    layer = Embedding(100, 16)
    assert layer.describe() == "Embedding(100, 16)"
    assert layer.output_shapes([(4, 7)]) == [(4, 7, 16)]
    assert layer.output_dtypes([np.int64]) == [np.float32]
    assert Embedding(3, 2, dtype=np.float64).output_dtypes([np.int32]) == [np.float64]
    spec = layer.param_specs()["weight"]
    assert spec.shape == (100, 16) and spec.init == "normal" and spec.gain == 1.0
    assert layer.nondiff_inputs == (0,) and layer.retain_inputs == (0,)
