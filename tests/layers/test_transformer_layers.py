"""Transformer layers: LayerNorm, GELU, PositionalEmbedding, MultiHeadAttention.

Finite differences in float64 (tests/layers/gradcheck.py), in place and float32 checks,
PyTorch parity of outputs and every gradient (torch as a test-time oracle only)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, seeds
from hypothesis import given
from hypothesis import strategies as st
from minidl.layers import GELU, Context, LayerNorm, PositionalEmbedding, ShapeError


def _torch():
    return pytest.importorskip("torch")


def _close(a, t, tol=1e-10):
    np.testing.assert_allclose(np.asarray(a), t.detach().numpy(), rtol=tol, atol=tol)


# ---------------------------------------------------------------- LayerNorm
@LAYER_SETTINGS
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2), dim=st.integers(1, 9),
       seed=seeds)
def test_layernorm_gradients(lead, dim, seed):
    rng = np.random.default_rng(seed)
    layer = LayerNorm(dim)
    xs = make_inputs(layer, [(*lead, dim)], rng)
    res = check_layer(layer, xs, rng=rng)
    x = xs[0]
    if dim > 1:
        y = res.outputs[0]
        p = res.params_after
        xhat = (y - p["bias"]) / p["weight"]
        np.testing.assert_allclose(xhat.mean(axis=-1), 0, atol=1e-10)
        np.testing.assert_allclose(res.stash["mean"], x.reshape(-1, dim).mean(axis=1))


def test_layernorm_many_rows_parts_and_accumulate():
    """More rows than one part of the parameter sums; accumulate adds into .grad."""
    rng = np.random.default_rng(3)
    layer = LayerNorm(5)
    x = rng.standard_normal((3, 200, 5))
    g = rng.standard_normal(x.shape)
    params = {"weight": rng.uniform(0.5, 2, 5), "bias": rng.standard_normal(5)}
    r = forward_backward(layer, Context(), [x], params, [g])
    xhat = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(r.grad_params["weight"], (g * xhat).sum((0, 1)), rtol=1e-12)
    np.testing.assert_allclose(r.grad_params["bias"], g.sum((0, 1)), rtol=1e-12)
    acc = forward_backward(layer, Context(accumulate=frozenset({"weight", "bias"})), [x],
                           params, [g])
    assert np.isnan(acc.grad_params["weight"]).all()  # garbage + sum: added, not written


def test_layernorm_torch_parity():
    torch = _torch()
    rng = np.random.default_rng(0)
    for eps in (1e-5, 1e-3):
        tl = torch.nn.LayerNorm(6, eps=eps).double()
        with torch.no_grad():
            tl.weight.copy_(torch.tensor(rng.uniform(0.5, 2, 6)))
            tl.bias.copy_(torch.tensor(rng.standard_normal(6)))
        x, g = rng.standard_normal((4, 3, 6)), rng.standard_normal((4, 3, 6))
        layer = LayerNorm(6, eps=eps)
        params = {k: v.detach().numpy().copy() for k, v in tl.state_dict().items()}
        res = forward_backward(layer, Context(), [x], params, [g])
        xt = torch.tensor(x, requires_grad=True)
        yt = tl(xt)
        yt.backward(torch.tensor(g))
        _close(res.outputs[0], yt)
        _close(res.grad_inputs[0], xt.grad)
        _close(res.grad_params["weight"], tl.weight.grad)
        _close(res.grad_params["bias"], tl.bias.grad)
        assert set(params) == set(layer.param_specs())


def test_layernorm_errors_and_describe():
    with pytest.raises(ShapeError, match=r"\(\*, 4\)"):
        LayerNorm(4).output_shapes([(2, 3)])
    with pytest.raises(ValueError, match="dim"):
        LayerNorm(0)
    assert LayerNorm(4).describe() == "LayerNorm(4)"
    assert LayerNorm(4, eps=1e-6).describe() == "LayerNorm(4, eps=1e-06)"


# ---------------------------------------------------------------- GELU
@LAYER_SETTINGS
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
       approximate=st.sampled_from(["none", "tanh"]), seed=seeds)
def test_gelu_gradients(shape, approximate, seed):
    rng = np.random.default_rng(seed)
    layer = GELU(approximate)
    xs = make_inputs(layer, [shape], rng)
    xs[0] *= 3
    check_layer(layer, xs, rng=rng)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_torch_parity(approximate):
    torch = _torch()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7)) * 4
    g = rng.standard_normal(x.shape)
    res = forward_backward(GELU(approximate), Context(), [x], {}, [g])
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.GELU(approximate=approximate)(xt)
    yt.backward(torch.tensor(g))
    _close(res.outputs[0], yt, 1e-12)
    _close(res.grad_inputs[0], xt.grad, 1e-12)
    x32, g32 = x.astype(np.float32), g.astype(np.float32)
    r32 = forward_backward(GELU(approximate), Context(), [x32], {}, [g32])
    xt32 = torch.tensor(x32, requires_grad=True)
    torch.nn.GELU(approximate=approximate)(xt32).backward(torch.tensor(g32))
    np.testing.assert_allclose(r32.grad_inputs[0], xt32.grad.numpy(), rtol=2e-6, atol=2e-6)


def test_gelu_reference_equals_numba_and_errors():
    from minidl.kernels import gelu as k

    rng = np.random.default_rng(2)
    x = rng.standard_normal(70_000) * 3  # above the serial threshold: threads
    for approx in ("none", "tanh"):
        a, b = np.empty_like(x), np.empty_like(x)
        k.gelu_forward(x, a, approx)
        k.gelu_forward_ref(x, b, approx)
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
        k.gelu_backward(x, x, a, approx)
        k.gelu_backward_ref(x, x, b, approx)
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    with pytest.raises(ValueError, match="approximate"):
        GELU("fast")
    assert GELU("tanh").describe() == "GELU(approximate='tanh')"


# ---------------------------------------------------------------- PositionalEmbedding
@LAYER_SETTINGS
@given(n=st.integers(1, 3), t=st.integers(1, 6), dim=st.integers(1, 4), seed=seeds)
def test_positional_embedding(n, t, dim, seed):
    rng = np.random.default_rng(seed)
    layer = PositionalEmbedding(6, dim)
    xs = make_inputs(layer, [(n, t, dim)], rng)
    res = check_layer(layer, xs, rng=rng)
    w = res.params_after["weight"]
    np.testing.assert_array_equal(res.outputs[0], xs[0] + w[:t])
    assert (res.grad_params["weight"][t:] == 0).all()


def test_positional_embedding_shapes():
    layer = PositionalEmbedding(4, 3)
    with pytest.raises(ShapeError, match="T <= 4"):
        layer.output_shapes([(2, 5, 3)])
    with pytest.raises(ShapeError):
        layer.output_shapes([(2, 3)])
    assert layer.param_specs()["weight"].shape == (4, 3)


def test_layernorm_kernel_threads_and_reference():
    """The threaded kernel equals the reference, and its bits do not depend on threads."""
    from minidl.kernels import layernorm as k
    from minidl.kernels.parallel import set_thread_policy

    rng = np.random.default_rng(4)
    x = rng.standard_normal((1000, 48)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w, b = rng.uniform(0.5, 2, 48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    outs = []
    try:
        for threads in (1, 2):
            set_thread_policy(threads)
            y, m, r = np.empty_like(x), np.empty(1000, np.float32), np.empty(1000, np.float32)
            k.layernorm_forward(x, w, b, y, m, r, 1e-5)
            dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
            ws = np.empty(k.backward_workspace_shape(1000, 48), np.float32)
            k.layernorm_backward(dy, x, w, m, r, dx, dw, db, ws)
            outs.append((y, dx, dw, db))
    finally:
        set_thread_policy(None)
    for a, b2 in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b2)
    y, m, r = np.empty_like(x), np.empty(1000, np.float32), np.empty(1000, np.float32)
    k.layernorm_forward_ref(x, w, b, y, m, r, 1e-5)
    np.testing.assert_allclose(outs[0][0], y, rtol=1e-5, atol=1e-5)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    k.layernorm_backward_ref(dy, x, w, m, r, dx, dw, db)
    for a, b2 in zip(outs[0][1:], (dx, dw, db), strict=True):
        np.testing.assert_allclose(a, b2, rtol=1e-4, atol=1e-4)
