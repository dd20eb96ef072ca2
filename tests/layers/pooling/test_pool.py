"""MaxPool2d / AvgPool2d layers: declarations, gradients (kink-aware), PyTorch parity."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, distinct_values, forward_backward, seeds
from hypothesis import assume, given
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.pooling.pool import AvgPool2d, MaxPool2d


@st.composite
def pools(draw, cls):
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    padding = (draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2)))
    layer = cls(k, stride, padding)
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 7)),
             draw(st.integers(1, 7)))
    try:
        layer.output_shapes([shape])
    except ShapeError:
        assume(False)
    return layer, shape


@LAYER_SETTINGS
@given(case=pools(MaxPool2d), seed=seeds)
def test_maxpool_gradients(case, seed):
    layer, shape = case
    rng = np.random.default_rng(seed)
    x = distinct_values(rng, shape, gap=1e-2)  # no ties: finite differences stay off kinks
    res = check_layer(layer, [x], rng=rng, h=1e-5)
    idx = res.stash["argmax"]
    assert idx.dtype == np.uint8 and idx.shape == res.outputs[0].shape


@LAYER_SETTINGS
@given(case=pools(AvgPool2d), seed=seeds)
def test_avgpool_gradients(case, seed):
    layer, shape = case
    rng = np.random.default_rng(seed)
    check_layer(layer, [rng.standard_normal(shape)], rng=rng)


def test_declarations():
    mp = MaxPool2d(2)
    assert mp.stride == (2, 2) and mp.padding == (0, 0)
    assert mp.retain_inputs == () and mp.retain_outputs == () and mp.kind == "pool"
    assert mp.stash_specs([(4, 3, 9, 8)], np.dtype(np.float32)) == {
        "argmax": ((4, 3, 4, 4), np.dtype(np.uint8))}
    assert mp.output_shapes([(4, 3, 9, 8)]) == [(4, 3, 4, 4)]
    assert MaxPool2d(3, 2, 1).output_shapes([(1, 1, 7, 7)]) == [(1, 1, 4, 4)]
    assert mp.forward_workspace_bytes([(4, 3, 9, 8)], np.dtype(np.float32)) == 0
    ap = AvgPool2d((3, 2), (1, 2), (1, 0))
    assert ap.output_shapes([(2, 5, 6, 6)]) == [(2, 5, 6, 3)]
    assert ap.stash_specs([(2, 5, 6, 6)], np.dtype(np.float32)) == {}
    assert ap.retain_inputs == () and ap.retain_outputs == ()
    assert repr(ap) == "AvgPool2d(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0))"
    with pytest.raises(ValueError, match="at most half"):
        MaxPool2d(2, padding=2)


def test_shape_errors_name_layer_and_shapes():
    mp = MaxPool2d(3)
    mp.name = "pool_a"
    with pytest.raises(ShapeError, match=r"pool_a.*\(N, C, H, W\).*\(3, 9, 9\)"):
        mp.output_shapes([(3, 9, 9)])
    with pytest.raises(ShapeError, match=r"pool_a.*positive output.*\(1, 2, 2, 9\)"):
        mp.output_shapes([(1, 2, 2, 9)])


def test_maxpool_backward_ignores_missing_grad_input():
    layer = MaxPool2d(2)
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    r = forward_backward(layer, Context(), [x], {}, [np.ones((1, 2, 2, 2))], need_grads=[False])
    assert r.grad_inputs == [None]


@pytest.mark.parametrize("k,s,p", [(2, None, 0), (3, 2, 1), ((3, 2), (1, 2), (1, 0))])
def test_match_torch_float32(k, s, p):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = distinct_values(rng, (4, 3, 10, 9), gap=1e-3, dtype=np.float32)
    for layer, tfn in ((MaxPool2d(k, s, p), torch.nn.functional.max_pool2d),
                       (AvgPool2d(k, s, p), torch.nn.functional.avg_pool2d)):
        dy = rng.standard_normal(layer.output_shapes([x.shape])[0]).astype(np.float32)
        res = forward_backward(layer, Context(), [x], {}, [dy])
        xt = torch.from_numpy(x).requires_grad_()
        yt = tfn(xt, k, s, p)
        yt.backward(torch.from_numpy(dy))
        np.testing.assert_allclose(res.outputs[0], yt.detach().numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(res.grad_inputs[0], xt.grad.numpy(), rtol=1e-5, atol=1e-6)
