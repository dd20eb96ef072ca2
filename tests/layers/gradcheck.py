"""Contract and gradient checks for layers, simulating the engine around the layer contract.

The helpers call ``forward`` / ``backward`` as the engine does:

* outputs, stash, gradients and workspace are freshly allocated and filled with garbage
  (NaN for floats), so an entry a layer forgets to write shows up;
* after forward, every input and output that is *not* declared in ``retain_inputs`` /
  ``retain_outputs`` is overwritten with garbage, and backward gets ``None`` at those indices,
  so a layer whose retain declarations are dishonest (or which keeps hidden references) fails;
* ``grad_inputs[i]`` is ``None`` for ``nondiff_inputs`` (and, on request, for others);
* in-place variants hand forward the input-0 array itself as output 0 and backward the
  grad-output-0 array as grad-input 0 (a reshaped view of the same memory if shapes differ).

``check_gradients`` compares backward with central finite differences of a random linear
functional of the outputs (float64), for inputs and trainable parameters. ``check_inplace``
checks that in-place execution gives bit-identical results; ``check_float32`` that a float32
run keeps float32 everywhere and agrees with float64.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

from minidl.layers import Context, Layer

#: Hypothesis settings for layer tests: few examples, no deadline (Numba compiles lazily).
LAYER_SETTINGS = settings(max_examples=20, deadline=None)


def shapes(min_rank: int = 1, max_rank: int = 4, min_side: int = 1, max_side: int = 5):
    """Strategy of batch-first shapes."""
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(
        tuple
    )


seeds = st.integers(0, 2**32 - 1)

# ---------------------------------------------------------------- building inputs and params


def garbage(shape, dtype) -> np.ndarray:
    """An array whose contents a layer must not rely on (NaN for floats)."""
    a = np.empty(shape, dtype=dtype)
    kind = a.dtype.kind
    if kind in "fc":
        a.fill(np.nan)
    elif kind in "iu":
        a.fill(np.iinfo(a.dtype).max)
    elif kind == "b":
        a.fill(True)
    return a


def away_from_kinks(x: np.ndarray, kinks=(0.0,), margin: float = 1e-3, rng=None) -> np.ndarray:
    """Move entries of ``x`` closer than ``margin`` to a kink to distance ``margin..2*margin``."""
    rng = rng or np.random.default_rng(0)
    for k in kinks:
        d = x - k
        close = np.abs(d) < margin
        if close.any():
            sign = np.where(d[close] >= 0, 1.0, -1.0)
            x[close] = k + sign * margin * (1.0 + rng.random(int(close.sum())))
    return x


def distinct_values(rng, shape, gap: float = 1e-2, dtype=np.float64) -> np.ndarray:
    """Random values pairwise at least ``gap`` apart (for max-like layers: no ties)."""
    n = int(np.prod(shape))
    v = (np.arange(n) - n / 2) * gap
    return rng.permutation(v).reshape(shape).astype(dtype)


def make_inputs(layer: Layer, in_shapes, rng, dtype=np.float64, int_inputs=None, kinks=(),
                margin: float = 1e-3) -> list[np.ndarray]:
    """Standard-normal float inputs; ``int_inputs`` maps an input index to ``high`` for
    integer inputs drawn from ``[0, high)``; ``kinks`` are points floats keep away from."""
    int_inputs = int_inputs or {}
    xs = []
    for i, s in enumerate(in_shapes):
        if i in int_inputs:
            xs.append(rng.integers(0, int_inputs[i], size=s).astype(np.int64))
        else:
            x = rng.standard_normal(s)
            if kinks:
                away_from_kinks(x, kinks, margin, rng)
            xs.append(x.astype(dtype))
    return xs


def make_params(layer: Layer, rng, dtype=np.float64, randomize: bool = True) -> dict:
    """Initial parameters; with ``randomize``, constant inits (ones/zeros) get random values
    so that e.g. BatchNorm's weight, bias and running statistics are exercised."""
    params = {}
    for name, spec in layer.param_specs().items():
        v = spec.initial_value(rng, dtype)
        if randomize and spec.init in ("ones", "zeros") and spec.dtype is None:
            if spec.init == "ones":
                v = rng.uniform(0.5, 2.0, size=spec.shape)
            else:
                v = rng.standard_normal(spec.shape)
            v = v.astype(dtype)
        params[name] = v
    return params


def _float_dtype(inputs, params) -> np.dtype:
    for a in list(inputs) + list(params.values()):
        if a.dtype.kind == "f":
            return a.dtype
    return np.dtype(np.float32)


def _alias(base: np.ndarray, shape) -> np.ndarray:
    return base if base.shape == tuple(shape) else base.reshape(shape)


def _workspace(nbytes: int):
    return None if nbytes == 0 else np.full(int(nbytes), 0xA5, dtype=np.uint8)


# ---------------------------------------------------------------- one engine-like step


@dataclass
class Result:
    outputs: list[np.ndarray]
    stash: dict[str, np.ndarray]
    grad_inputs: list[Any]
    grad_params: dict[str, np.ndarray]
    params_after: dict[str, np.ndarray]


def run_forward(layer: Layer, ctx: Context, inputs, params, inplace: bool = False):
    """Forward on fresh (garbage-filled) outputs and stash; returns (outputs, stash)."""
    in_shapes = [tuple(x.shape) for x in inputs]
    out_shapes = layer.output_shapes(in_shapes)
    out_dtypes = layer.output_dtypes([x.dtype for x in inputs])
    assert len(out_shapes) == len(out_dtypes) == layer.num_outputs
    dtype = _float_dtype(inputs, params)
    outputs = [garbage(s, d) for s, d in zip(out_shapes, out_dtypes, strict=True)]
    if inplace:
        assert layer.inplace_forward
        assert outputs[0].dtype == inputs[0].dtype and outputs[0].size == inputs[0].size
        outputs[0] = _alias(inputs[0], out_shapes[0])
    stash = {k: garbage(s, d) for k, (s, d) in layer.stash_specs(in_shapes, dtype).items()}
    ws = _workspace(layer.forward_workspace_bytes(in_shapes, dtype))
    layer.forward(ctx, list(inputs), outputs, params, stash, ws)
    for o, s, d in zip(outputs, out_shapes, out_dtypes, strict=True):
        assert o.shape == tuple(s) and o.dtype == d
    return outputs, stash


def forward_backward(layer: Layer, ctx: Context, inputs, params, grad_outputs=None, *,
                     inplace_forward: bool = False, inplace_backward: bool = False,
                     need_grads=None) -> Result:
    """One forward and one backward as the engine runs them (see the module docstring).

    Inputs, params and grad_outputs are copied first, so the caller's arrays are untouched.
    ``grad_outputs=None`` skips backward. ``need_grads[i]=False`` passes ``None`` as
    ``grad_inputs[i]``.
    """
    inputs = [np.array(x, copy=True) for x in inputs]
    params = {k: np.array(v, copy=True) for k, v in params.items()}
    ctx = copy.deepcopy(ctx)
    outputs, stash = run_forward(layer, ctx, inputs, params, inplace=inplace_forward)
    out_copies = [np.array(o, copy=True) for o in outputs]
    params_after = {k: np.array(v, copy=True) for k, v in params.items()}
    if grad_outputs is None:
        return Result(out_copies, stash, [], {}, params_after)

    # The engine may reuse the memory of anything backward does not retain.
    kept_in = [x if i in layer.retain_inputs else None for i, x in enumerate(inputs)]
    kept_out = [o if i in layer.retain_outputs else None for i, o in enumerate(outputs)]
    kept = [a for a in kept_in + kept_out if a is not None]
    for a in list(inputs) + list(outputs):
        if not any(np.shares_memory(a, k) for k in kept):
            a[...] = garbage(a.shape, a.dtype)

    in_shapes = [tuple(x.shape) for x in inputs]
    dtype = _float_dtype(inputs, params)
    grad_outputs = [np.array(g, copy=True) for g in grad_outputs]
    need = list(need_grads) if need_grads is not None else [True] * len(inputs)
    grad_inputs = [
        None if (i in layer.nondiff_inputs or not need[i]) else garbage(x.shape, x.dtype)
        for i, x in enumerate(inputs)
    ]
    if inplace_backward:
        assert layer.inplace_backward and grad_inputs[0] is not None
        assert grad_outputs[0].size == grad_inputs[0].size
        grad_inputs[0] = _alias(grad_outputs[0], inputs[0].shape)
    trainable = {k for k, s in layer.param_specs().items() if s.trainable}
    grad_params = {k: garbage(v.shape, v.dtype) for k, v in params.items() if k in trainable}
    ws = _workspace(layer.backward_workspace_bytes(in_shapes, dtype))
    layer.backward(ctx, grad_outputs, grad_inputs, kept_in, kept_out, params, grad_params,
                   stash, ws)
    return Result(out_copies, stash, grad_inputs, grad_params, params_after)


# ---------------------------------------------------------------- checks


def _functional(outputs, weights) -> float:
    pairs = zip(weights, outputs, strict=True)
    return float(sum(np.vdot(w, np.asarray(o, dtype=np.float64)) for w, o in pairs))


def check_gradients(layer: Layer, inputs, params=None, ctx=None, *, rng=None, h: float = 1e-6,
                    rtol: float = 1e-5, atol: float = 1e-6, max_points: int = 48) -> Result:
    """Backward vs central finite differences of ``sum_j <w_j, y_j>`` (random ``w_j``).

    Checks every differentiable input and trainable parameter at up to ``max_points`` random
    entries each; also checks that passing ``None`` grad_inputs leaves parameter gradients
    unchanged. Inputs must be float64; keep them away from kinks (see ``away_from_kinks``).
    """
    rng = rng or np.random.default_rng(0)
    params = make_params(layer, rng) if params is None else params
    ctx = ctx or Context()
    out_shapes = layer.output_shapes([tuple(x.shape) for x in inputs])
    weights = [rng.standard_normal(s) for s in out_shapes]
    res = forward_backward(layer, ctx, inputs, params, weights)

    def loss(xs, ps) -> float:
        r = forward_backward(layer, ctx, xs, ps)
        return _functional(r.outputs, weights)

    def numeric(get, idx) -> np.ndarray:
        out = np.empty(len(idx))
        for j, k in enumerate(idx):
            xs = [np.array(x, copy=True) for x in inputs]
            ps = {n: np.array(v, copy=True) for n, v in params.items()}
            a = get(xs, ps)
            orig = a.flat[k]
            a.flat[k] = orig + h
            up = loss(xs, ps)
            a.flat[k] = orig - h
            down = loss(xs, ps)
            out[j] = (up - down) / (2 * h)
        return out

    def compare(name, analytic, get):
        assert analytic.dtype == np.float64, f"{name}: gradient dtype {analytic.dtype}"
        assert np.all(np.isfinite(analytic)), f"{layer.describe()}: {name} gradient not written"
        size = analytic.size
        idx = rng.choice(size, size=min(size, max_points), replace=False)
        num = numeric(get, idx)
        scale = max(1.0, float(np.max(np.abs(analytic))))
        np.testing.assert_allclose(
            analytic.flat[idx], num, rtol=rtol, atol=atol * scale,
            err_msg=f"{layer.describe()}: gradient of {name}",
        )

    for i, g in enumerate(res.grad_inputs):
        if g is not None:
            compare(f"input {i}", g, lambda xs, ps, i=i: xs[i])
    for name, g in res.grad_params.items():
        compare(f"param {name}", g, lambda xs, ps, name=name: ps[name])

    if res.grad_params:
        none = forward_backward(layer, ctx, inputs, params, weights,
                                need_grads=[False] * len(inputs))
        for name, g in res.grad_params.items():
            np.testing.assert_allclose(none.grad_params[name], g, rtol=1e-12, atol=1e-12)
    return res


def check_inplace(layer: Layer, inputs, params=None, ctx=None, *, rng=None) -> None:
    """Declared in-place forward/backward must be consistent and give identical results."""
    rng = rng or np.random.default_rng(0)
    params = make_params(layer, rng) if params is None else params
    ctx = ctx or Context()
    if layer.inplace_forward:
        assert 0 not in layer.retain_inputs, "in-place forward destroys a retained input"
    out_shapes = layer.output_shapes([tuple(x.shape) for x in inputs])
    out_dtypes = layer.output_dtypes([x.dtype for x in inputs])
    grads = [rng.standard_normal(s).astype(d) for s, d in zip(out_shapes, out_dtypes, strict=True)]
    ref = forward_backward(layer, ctx, inputs, params, grads)
    got = forward_backward(layer, ctx, inputs, params, grads,
                           inplace_forward=layer.inplace_forward,
                           inplace_backward=layer.inplace_backward)
    for a, b in zip(ref.outputs, got.outputs, strict=True):
        np.testing.assert_array_equal(a, b)
    for k in ref.stash:
        np.testing.assert_array_equal(ref.stash[k], got.stash[k])
    for a, b in zip(ref.grad_inputs, got.grad_inputs, strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, b)
    for k in ref.grad_params:
        np.testing.assert_array_equal(ref.grad_params[k], got.grad_params[k])


def check_float32(layer: Layer, inputs, params=None, ctx=None, *, rng=None,
                  rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """A float32 run keeps float32 outputs, stash and gradients and agrees with float64."""
    rng = rng or np.random.default_rng(0)
    params = make_params(layer, rng) if params is None else params
    ctx = ctx or Context()
    out_shapes = layer.output_shapes([tuple(x.shape) for x in inputs])
    grads = [rng.standard_normal(s) for s in out_shapes]

    def cast(a):
        return a.astype(np.float32) if a.dtype.kind == "f" else a

    r64 = forward_backward(layer, ctx, inputs, params, grads)
    r32 = forward_backward(layer, ctx, [cast(x) for x in inputs],
                           {k: cast(v) for k, v in params.items()}, [cast(g) for g in grads])
    pairs = list(zip(r32.outputs, r64.outputs, strict=True))
    pairs += list(zip(r32.grad_inputs, r64.grad_inputs, strict=True))
    pairs += [(r32.grad_params[k], r64.grad_params[k]) for k in r64.grad_params]
    pairs += [(r32.params_after[k], r64.params_after[k]) for k in r64.params_after]
    for a32, a64 in pairs:
        if a32 is None:
            continue
        if a64.dtype.kind == "f":
            assert a32.dtype == np.float32, f"{layer.describe()}: float32 run made {a32.dtype}"
        scale = max(1.0, float(np.max(np.abs(a64)))) if a64.size else 1.0
        np.testing.assert_allclose(a32, a64, rtol=rtol, atol=atol * scale)
    for k, v in r32.stash.items():
        if r64.stash[k].dtype.kind == "f":
            assert v.dtype == np.float32, f"stash {k} is {v.dtype} in a float32 run"


def check_layer(layer: Layer, inputs, params=None, ctx=None, *, rng=None,
                float32: bool = True, **grad_kw) -> Result:
    """All checks: declarations, gradients, in-place consistency and (optionally) float32."""
    rng = rng or np.random.default_rng(0)
    params = make_params(layer, rng) if params is None else params
    ctx = ctx or Context()
    check_declarations(layer, [tuple(x.shape) for x in inputs])
    res = check_gradients(layer, inputs, params, ctx, rng=rng, **grad_kw)
    if layer.inplace_forward or layer.inplace_backward:
        check_inplace(layer, inputs, params, ctx, rng=rng)
    if float32:
        check_float32(layer, inputs, params, ctx, rng=rng)
    return res


def check_declarations(layer: Layer, in_shapes) -> None:
    """Static declarations are well-formed for these input shapes."""
    assert isinstance(layer.kind, str) and layer.kind != "generic"
    assert isinstance(layer.describe(), str) and layer.describe()
    n_in = len(in_shapes)
    assert layer.num_inputs in (None, n_in)
    assert all(0 <= i < n_in for i in layer.retain_inputs + layer.nondiff_inputs)
    assert all(0 <= i < layer.num_outputs for i in layer.retain_outputs)
    flops = layer.flops(in_shapes)
    assert isinstance(flops, int) and flops >= 0
    for dt in (np.float32, np.float64):
        for f in (layer.forward_workspace_bytes, layer.backward_workspace_bytes):
            b = f(in_shapes, np.dtype(dt))
            assert isinstance(b, int) and b >= 0
    for spec in layer.param_specs().values():
        assert all(isinstance(d, int) and d > 0 for d in spec.shape)
