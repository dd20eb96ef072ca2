"""Transformer layers: LayerNorm, GELU, PositionalEmbedding, MultiHeadAttention.

Finite differences in float64 (tests/layers/gradcheck.py), in place and float32 checks,
PyTorch parity of outputs and every gradient (torch as a test-time oracle only)."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import (
    LAYER_SETTINGS,
    check_layer,
    forward_backward,
    make_inputs,
    make_params,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import (
    GELU,
    Context,
    LayerNorm,
    MultiHeadAttention,
    PositionalEmbedding,
    ShapeError,
)
from minidl.layers.transformer.attention import NANOGPT_NAMES, NN_MULTIHEAD_NAMES


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
    # float32 against float64 only where a row's spread is well above float32's resolution:
    # two nearly equal entries (variance 4.7e-5 at seed 798, dim 2) lose x - mean's digits in
    # float32, which the input gradient then divides by a standard deviation near eps's
    conditioned = dim == 1 or float(np.var(xs[0], axis=-1).min()) > 1e-3
    res = check_layer(layer, xs, rng=rng, float32=conditioned)
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
    from minidl.kernels.transformer import gelu as k

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
    x32 = np.concatenate([x, [0.0, 1e-30, -40.0, 40.0, -5.6, 5.6]]).astype(np.float32)
    a, b = np.empty_like(x32), np.empty_like(x32)
    k.gelu_forward(x32, a)  # float32: the rational erf
    b = np.empty(x32.shape)
    k.gelu_forward_ref(x32.astype(np.float64), b, "none")
    np.testing.assert_allclose(a, b, rtol=3e-7, atol=3e-7)
    assert a[-3] == 40.0 and a[-4] == 0.0
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
    from minidl.kernels.normalization import layernorm as k
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


# ---------------------------------------------------------------- MultiHeadAttention
class _Form(MultiHeadAttention):
    """The layer with its ``attn`` option fixed, so the gradcheck helpers (which pass no
    options to the declarations) size stash and workspace for that form."""

    def __init__(self, form, *args, **kw):
        super().__init__(*args, **kw)
        self.form = form

    def _geometry(self, in_shapes, options):
        return super()._geometry(in_shapes, options or {"attn": self.form})


def _ctx(form, **kw):
    return Context(options={"attn": form}, **kw)


@LAYER_SETTINGS
@given(b=st.integers(1, 2), t=st.integers(1, 7), heads=st.integers(1, 3),
       hd=st.integers(1, 3), causal=st.booleans(), dropout=st.sampled_from([0.0, 0.3]),
       form=st.sampled_from(["keep", "blockwise:1", "blockwise:3", "blockwise:16"]),
       seed=seeds)
def test_attention_gradients(b, t, heads, hd, causal, dropout, form, seed):
    """Finite differences of every input and parameter, with dropout too (the mask is a fixed
    function of the seed, so the layer is a smooth function for a given seed)."""
    rng = np.random.default_rng(seed)
    d = heads * hd
    layer = _Form(form, d, heads, causal=causal, dropout=dropout)
    xs = make_inputs(layer, [(b, t, d)], rng)
    check_layer(layer, xs, ctx=_ctx(form, seed=seed), rng=rng)


def _run(layer, x, params, g, form, training=True, seed=0):
    """Forward and backward in stash and workspaces of exactly the declared sizes for
    ``form`` (canaries after the workspaces must survive, NaN-filled outputs)."""
    ctx = _ctx(form, training=training, seed=seed)
    shp, dt = [x.shape], x.dtype
    stash = {k: np.full(s, np.nan, d) for k, (s, d) in
             layer.stash_specs(shp, dt, options=ctx.options).items()}
    bufs = []
    for f in (layer.forward_workspace_bytes, layer.backward_workspace_bytes):
        n = f(shp, dt, options=ctx.options)
        bufs.append((np.full(n + 64, 0xA5, np.uint8), n))
    y = np.full(x.shape, np.nan, dt)
    layer.forward(ctx, [x], [y], params, stash, None if not bufs[0][1] else bufs[0][0][:bufs[0][1]])
    dx = np.full(x.shape, np.nan, dt)
    grads = {k: np.full(v.shape, np.nan, dt) for k, v in params.items()}
    layer.backward(ctx, [g], [dx], [x], [None], params, grads, stash, bufs[1][0][:bufs[1][1]])
    for buf, n in bufs:
        assert (buf[n:] == 0xA5).all()
    return y, dx, grads, stash


def _torch_attention(torch, dim, heads, causal, style):
    """A PyTorch twin: ``"sdpa"`` (nn.Linear ``qkv`` / ``proj`` + scaled_dot_product_attention,
    this layer's names), ``"nanogpt"`` (``c_attn`` / ``c_proj``) or ``"nn"``
    (``nn.MultiheadAttention``, batch first)."""
    nn, F = torch.nn, torch.nn.functional
    if style == "nn":
        m = nn.MultiheadAttention(dim, heads, batch_first=True)

        def run(x):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1) if causal else None
            return m(x, x, x, attn_mask=mask, need_weights=False)[0]
        return m.double(), run
    names = ("c_attn", "c_proj") if style == "nanogpt" else ("qkv", "proj")

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            setattr(self, names[0], nn.Linear(dim, 3 * dim))
            setattr(self, names[1], nn.Linear(dim, dim))

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = getattr(self, names[0])(x).split(d, dim=2)
            q, k, v = (a.view(b, t, heads, d // heads).transpose(1, 2) for a in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return getattr(self, names[1])(o.transpose(1, 2).reshape(b, t, d))

    m = Attention().double()
    return m, m


@pytest.mark.parametrize("style", ["sdpa", "nanogpt", "nn"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_torch_parity(causal, style):
    """Outputs and every gradient equal PyTorch's (float64, dropout off) in both forms; the
    weights move both ways through the documented name maps with strict loads."""
    torch = _torch()
    rng = np.random.default_rng(5)
    b, t, d, h = 2, 9, 12, 3
    tm, run = _torch_attention(torch, d, h, causal, style)
    names = {"sdpa": {k: k for k in NANOGPT_NAMES}, "nanogpt": NANOGPT_NAMES,
             "nn": NN_MULTIHEAD_NAMES}[style]
    state = tm.state_dict()
    params = {ours: state[theirs].numpy().copy() for ours, theirs in names.items()}
    assert set(params) == set(MultiHeadAttention(d, h).param_specs())
    tm.load_state_dict({names[k]: torch.tensor(v) for k, v in params.items()}, strict=True)
    x, g = rng.standard_normal((b, t, d)), rng.standard_normal((b, t, d))
    xt = torch.tensor(x, requires_grad=True)
    yt = run(xt)
    yt.backward(torch.tensor(g))
    tgrads = dict(tm.named_parameters())
    layer = MultiHeadAttention(d, h, causal=causal)
    for form in ("keep", "blockwise:4"):
        y, dx, grads, _ = _run(layer, x, params, g, form)
        _close(y, yt)
        _close(dx, xt.grad)
        for ours, theirs in names.items():
            _close(grads[ours], tgrads[theirs].grad)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_matches_keep_and_is_deterministic(causal, dtype, tol):
    """Blockwise forms agree with ``keep`` to float rounding (relative to the largest value;
    float64 1e-12, float32 2e-5), with dropout too (the same masks), and each form is
    bit-identical run to run."""
    rng = np.random.default_rng(6)
    b, t, d, h = 2, 37, 16, 4
    layer = MultiHeadAttention(d, h, causal=causal, dropout=0.25)
    params = {k: v.astype(dtype) for k, v in make_params(layer, rng).items()}
    x = rng.standard_normal((b, t, d)).astype(dtype)
    g = rng.standard_normal((b, t, d)).astype(dtype)
    ref = _run(layer, x, params, g, "keep", seed=11)
    for form in ("blockwise:1", "blockwise:8", "blockwise:37", "blockwise:64"):
        got = _run(layer, x, params, g, form, seed=11)
        again = _run(layer, x, params, g, form, seed=11)
        for a, r, a2 in zip(got[:2] + tuple(got[2].values()), ref[:2] + tuple(ref[2].values()),
                            again[:2] + tuple(again[2].values()), strict=True):
            np.testing.assert_allclose(a, r, rtol=0, atol=tol * float(np.abs(r).max()),
                                       err_msg=form)
            np.testing.assert_array_equal(a, a2)
        lse = got[3]["lse"]
        assert lse.shape == (b, h, t) and np.isfinite(lse).all()
    other = _run(layer, x, params, g, "keep", seed=12)
    assert not np.array_equal(other[0], ref[0])  # another seed, another mask
    evals = [_run(layer, x, params, g, f, training=False)[0] for f in ("keep", "blockwise:5")]
    np.testing.assert_allclose(evals[0], evals[1], rtol=0, atol=tol * np.abs(evals[0]).max())


def test_attention_declarations_and_errors():
    layer = MultiHeadAttention(8, 2, causal=True)
    dt = np.dtype(np.float32)
    keep = layer.stash_specs([(4, 16, 8)], dt)
    assert keep["probs"] == ((4, 2, 16, 16), dt) and keep["qkv"] == ((4, 16, 24), dt)
    blk = layer.stash_specs([(4, 16, 8)], dt, options={"attn": "blockwise:4"})
    assert "probs" not in blk and blk["lse"] == ((4, 2, 16), dt)
    for bad in ("blockwise", "blockwise:0", "blockwise:x", "flash", 3):
        with pytest.raises(ValueError, match="attention form"):
            layer.stash_specs([(4, 16, 8)], dt, options={"attn": bad})
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="dropout"):
        MultiHeadAttention(8, 2, dropout=1.0)
    with pytest.raises(ShapeError):
        layer.output_shapes([(4, 16, 6)])
    assert layer.memory_attrs([(4, 16, 8)])["attention"] == {
        "batch": 4, "seq": 16, "dim": 8, "heads": 2, "causal": True, "dropout": False}
    assert layer.describe() == "MultiHeadAttention(8, heads=2, causal=True)"
    assert "attn" in layer.option_names
