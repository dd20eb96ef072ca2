"""Every layer (but the convolution and pooling ones), loss, optimizer update and codec on the
strict CUDA test device (:mod:`minidl.memory.testing.strict_device`): arrays that refuse implicit
host
conversion and whose every NumPy call is checked against the installed ``cupy`` package.

Each case runs one engine-like forward and backward twice, on NumPy arrays and on strict
device arrays (arena views at distinct offsets, NaN-filled outputs, stash, gradients and
0xFF workspaces, unretained inputs and outputs overwritten before backward), and compares:
bit-identical where both run the same operations, else within 1e-6 relative (float32; the CPU
runs Numba kernels, the device the NumPy references, i.e. what CuPy would run).
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import numpy as np
import pytest

from minidl.layers import (
    GRU,
    LSTM,
    Add,
    BatchNorm1d,
    BatchNorm2d,
    Concat,
    Context,
    Dropout,
    Embedding,
    Flatten,
    GRUCell,
    Layer,
    LeakyReLU,
    Linear,
    LSTMCell,
    MSELoss,
    ReLU,
    RNNInputProjection,
    Sigmoid,
    SoftmaxCrossEntropy,
    Tanh,
    TimeStack,
    ZeroState,
)

strict = pytest.importorskip("minidl.memory.testing.strict_device")
if not strict.cupy_available():
    pytest.skip("the strict device reads CuPy's API from the cupy package", allow_module_level=True)

from strict_mem import DeviceMem, HostMem  # noqa: E402
from strict_mem import garbage as _garbage  # noqa: E402
from strict_mem import normal as _normal  # noqa: E402
from strict_mem import workspace as _workspace  # noqa: E402

from minidl.memory.passes import bptt  # noqa: E402

RTOL = 1e-6


@pytest.fixture(scope="module")
def dev():
    return strict.StrictCudaDevice("64MiB")



def _opts(layer: Layer, ctx: Context, mem=None) -> dict:
    """The options keyword of the layer's declarations, with the device kind the engine's
    lowering would set (``cuda`` on the strict device)."""
    if not layer.option_names:
        return {}
    options = dict(ctx.options)
    if "device_kind" in layer.option_names:
        options["device_kind"] = "cuda" if isinstance(mem, DeviceMem) else "cpu"
    return {"options": options}


def _step(layer: Layer, ctx: Context, inputs, params, grads, mem, *, inplace: bool = False,
          need=None, grad_init=None) -> dict[str, np.ndarray]:
    """One forward and backward as the engine runs them; every result as a host array.

    ``grad_init`` holds the starting value of the gradients named in ``ctx.accumulate``."""
    xs = [mem.put(x) for x in inputs]
    ps = {k: mem.put(v) for k, v in params.items()}
    shapes = [tuple(x.shape) for x in inputs]
    dtype = next((a.dtype for a in list(inputs) + list(params.values()) if a.dtype.kind == "f"),
                 np.dtype(np.float32))
    out_shapes = layer.output_shapes(shapes)
    out_dtypes = layer.output_dtypes([x.dtype for x in inputs])
    ys = [_garbage(mem, s, d) for s, d in zip(out_shapes, out_dtypes, strict=True)]
    if inplace:
        ys[0] = xs[0].reshape(out_shapes[0])
    opts = _opts(layer, ctx, mem)
    stash = {k: _garbage(mem, s, d)
             for k, (s, d) in layer.stash_specs(shapes, dtype, **opts).items()}
    ws = _workspace(mem, layer.forward_workspace_bytes(shapes, dtype, **opts))
    layer.forward(ctx, xs, ys, ps, stash, ws)
    out = {f"y{i}": mem.get(y) for i, y in enumerate(ys)}
    out.update({f"stash.{k}": mem.get(v) for k, v in stash.items()})
    out.update({f"param.{k}": mem.get(v) for k, v in ps.items()})
    if grads is None:
        return out
    kept_in = [x if i in layer.retain_inputs else None for i, x in enumerate(xs)]
    kept_out = [y if i in layer.retain_outputs else None for i, y in enumerate(ys)]
    kept = [a for a in kept_in + kept_out if a is not None]
    for a in xs + ys:  # the engine may reuse what backward does not retain
        if not any(np.shares_memory(a, k) for k in kept):
            if a.dtype.kind == "f":
                mem.fill(a, np.nan)
    dys = [None if g is None else mem.put(g) for g in grads]
    need = [True] * len(xs) if need is None else need
    dxs = [None if (i in layer.nondiff_inputs or not need[i]) else _garbage(mem, x.shape,
                                                                             x.dtype)
           for i, x in enumerate(inputs)]
    if inplace and layer.inplace_backward and dxs[0] is not None:
        dxs[0] = dys[0].reshape(inputs[0].shape)
    specs = layer.param_specs()
    gps = {}
    for k, v in params.items():
        if specs[k].trainable:
            if k in ctx.accumulate:
                gps[k] = mem.put(grad_init[k])
            else:
                gps[k] = _garbage(mem, v.shape, v.dtype)
    bws = _workspace(mem, layer.backward_workspace_bytes(shapes, dtype, **opts))
    layer.backward(ctx, dys, dxs, kept_in, kept_out, ps, gps, stash, bws)
    out.update({f"dx{i}": mem.get(d) for i, d in enumerate(dxs) if d is not None})
    out.update({f"grad.{k}": mem.get(v) for k, v in gps.items()})
    return out


def _compare(got: dict, want: dict, exact: bool, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {k}"
        if exact or w.dtype.kind not in "fc":
            np.testing.assert_array_equal(g, w, err_msg=f"{what}: {k}")
        else:
            scale = float(np.max(np.abs(w))) if w.size else 0.0
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale,
                                       err_msg=f"{what}: {k}")


def check(dev, layer: Layer, inputs, params=None, grads="random", *, ctx=None, exact=True,
          inplace=None, need=None, seed=0, accumulate=()) -> dict:
    """The layer on NumPy and on strict device arrays, compared (see the module docstring):
    bit for bit unless ``exact=False`` (a Numba CPU kernel computing differently from its
    reference); also in place when the layer declares it (or ``inplace``), and with gradients
    accumulated into the parameters named in ``accumulate``."""
    rng = np.random.default_rng(seed)
    if params is None:
        params = {}
        for name, spec in layer.param_specs().items():
            v = spec.initial_value(rng, np.float32)
            if spec.init in ("ones", "zeros") and spec.dtype is None:
                v = rng.uniform(0.5, 2.0, spec.shape).astype(np.float32)
            params[name] = v
    ctx = ctx or Context(seed=seed)
    if isinstance(grads, str):
        shapes = layer.output_shapes([tuple(x.shape) for x in inputs])
        dts = layer.output_dtypes([x.dtype for x in inputs])
        grads = [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dts, strict=True)]
    if accumulate:
        ctx = dataclasses.replace(ctx, accumulate=frozenset(accumulate))
    grad_init = {k: rng.standard_normal(params[k].shape).astype(params[k].dtype)
                 for k in accumulate}
    want = _step(layer, copy.deepcopy(ctx), inputs, params, grads, HostMem(), need=need,
                 grad_init=grad_init)
    calls = dev.checked_calls
    got = _step(layer, copy.deepcopy(ctx), inputs, params, grads, DeviceMem(dev), need=need,
                grad_init=grad_init)
    assert dev.checked_calls > calls
    _compare(got, want, exact, layer.describe())
    if inplace is None:
        inplace = layer.inplace_forward
    if inplace:
        got = _step(layer, copy.deepcopy(ctx), inputs, params, grads, DeviceMem(dev),
                    inplace=True, need=need, grad_init=grad_init)
        _compare(got, want, exact, f"{layer.describe()} in place")
    gc.collect()
    assert dev.default_pool_bytes == 0, "temporaries outlived the step"
    return want


# ---------------------------------------------------------------- simple layers
@pytest.mark.parametrize("layer", [ReLU(), Sigmoid(), Tanh(), LeakyReLU(0.1), LeakyReLU(-0.2)],
                         ids=lambda x: x.describe())
def test_activations(dev, layer):
    rng = np.random.default_rng(1)
    check(dev, layer, [_normal(rng, 3, 5, 7)])


def test_relu_kernels(dev):
    from minidl.kernels.pointwise.relu import relu_backward, relu_forward

    rng = np.random.default_rng(18)
    x, dy = _normal(rng, 4, 300), _normal(rng, 4, 300)
    x[0, :3] = [np.nan, -0.0, 0.0]
    mem = DeviceMem(dev)
    x_d, dy_d, y_d = mem.put(x), mem.put(dy), _garbage(mem, x.shape, x.dtype)
    y, dx = np.empty_like(x), np.empty_like(x)
    relu_forward(x, y)
    relu_backward(dy, y, dx)
    relu_forward(x_d, y_d)
    relu_backward(dy_d, y_d, dy_d)  # in place
    np.testing.assert_array_equal(y_d.get(), y)
    np.testing.assert_array_equal(dy_d.get(), dx)


def test_flatten_add_concat_time_stack_zero_state(dev):
    rng = np.random.default_rng(2)
    check(dev, Flatten(), [_normal(rng, 2, 3, 4, 5)])
    check(dev, Flatten(2, 3), [_normal(rng, 2, 3, 4, 5)])
    check(dev, Add(), [_normal(rng, 4, 6), _normal(rng, 4, 6), _normal(rng, 4, 6)])
    check(dev, Concat(1), [_normal(rng, 2, 3, 4), _normal(rng, 2, 5, 4)])
    check(dev, Concat(-1), [_normal(rng, 2, 3, 4), _normal(rng, 2, 3, 1)],
          need=[False, True])
    check(dev, TimeStack(), [_normal(rng, 3, 4) for _ in range(5)])
    check(dev, ZeroState(2, 5), [_normal(rng, 3, 7)])


@pytest.mark.parametrize("bias", [True, False])
def test_linear(dev, bias):
    rng = np.random.default_rng(3)
    check(dev, Linear(6, 5, bias), [_normal(rng, 4, 6)])
    check(dev, Linear(6, 5, bias), [_normal(rng, 2, 3, 6)], accumulate=(
        ("weight", "bias") if bias else ("weight",)))


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("cls,shape", [(BatchNorm1d, (6, 3)), (BatchNorm1d, (4, 3, 5)),
                                       (BatchNorm2d, (2, 3, 4, 5))])
def test_batchnorm(dev, cls, shape, training):
    rng = np.random.default_rng(4)
    x = _normal(rng, *shape) * 3 + 1
    # float64 sums in one loop on the CPU, pairwise in the reference
    check(dev, cls(3), [x], ctx=Context(training=training), exact=False)
    check(dev, cls(3, momentum=None), [x], ctx=Context(training=training),
          accumulate=("weight", "bias"), exact=False)
    check(dev, cls(3, affine=False, track_running_stats=False), [x],
          ctx=Context(training=training), exact=False)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout(dev, p, training):
    rng = np.random.default_rng(5)
    check(dev, Dropout(p), [_normal(rng, 3, 50, 7)], ctx=Context(training=training, seed=11))


def test_dropout_large_crosses_chunks(dev):
    rng = np.random.default_rng(6)
    check(dev, Dropout(0.5), [_normal(rng, 3, 70_000)], ctx=Context(seed=3))


def test_embedding(dev):
    rng = np.random.default_rng(7)
    idx = rng.integers(0, 9, (4, 5))
    check(dev, Embedding(9, 6), [idx])
    check(dev, Embedding(9, 6), [idx], accumulate=("weight",))


def test_losses(dev):
    rng = np.random.default_rng(8)
    check(dev, MSELoss(), [_normal(rng, 4, 5), _normal(rng, 4, 5)])
    for eps in (0.0, 0.1):
        check(dev, SoftmaxCrossEntropy(eps), [_normal(rng, 6, 7), rng.integers(0, 7, 6)])
        check(dev, SoftmaxCrossEntropy(eps), [_normal(rng, 2, 3, 4), rng.integers(0, 4, (2, 3))])


# ---------------------------------------------------------------- RNN layers
@pytest.mark.parametrize("bias", [True, False])
def test_rnn_cells_and_projection(dev, bias):
    rng = np.random.default_rng(9)
    n, h = 3, 4
    # the CPU's gate kernels evaluate sigmoid and tanh with an exp of their own
    lstm_in = [_normal(rng, n, 4 * h), _normal(rng, n, h), _normal(rng, n, h)]
    check(dev, LSTMCell(h, bias), lstm_in, exact=False)
    check(dev, LSTMCell(h, bias), lstm_in, need=[False, True, False], exact=False)
    gru_in = [_normal(rng, n, 3 * h), _normal(rng, n, h)]
    check(dev, GRUCell(h, bias), gru_in, exact=False)
    check(dev, GRUCell(h, bias), gru_in, need=[False, True], exact=False)
    check(dev, RNNInputProjection(5, 8, 3, bias), [_normal(rng, n, 3, 5)])
    check(dev, RNNInputProjection(5, 8, 3, bias, step_inputs=True),
          [_normal(rng, n, 5) for _ in range(3)])


RNN_CASES = [
    ("lstm", {}),
    ("gru", {}),
    ("lstm", {"num_layers": 2, "initial_state": True}),
    ("gru", {"num_layers": 2, "initial_state": True, "bias": False}),
    ("lstm", {"vocab_size": 5}),  # table path (V <= N*T)
    ("gru", {"vocab_size": 40}),  # gather path (V > N*T)
]


@pytest.mark.parametrize("scheduled", [False, True], ids=["keep_all", "scheduled"])
@pytest.mark.parametrize("cell,kw", RNN_CASES, ids=lambda c: str(c))
def test_fused_rnn(dev, cell, kw, scheduled, monkeypatch):
    from minidl.layers.recurrent import keep_all as recurrent_keep_all

    workers = []
    run_tasks = recurrent_keep_all.run_tasks
    monkeypatch.setattr(recurrent_keep_all, "run_tasks",
                        lambda tasks, n, durations=None: (workers.append(n),
                                                          run_tasks(tasks, n, durations)))
    rng = np.random.default_rng(10)
    n, t, i, h, us = 3, 7, 4, 5, 3
    units = -(-t // us)
    sched = bptt.sqrt_schedule(units) if scheduled else None
    layer = {"lstm": LSTM, "gru": GRU}[cell](i, h, unit_steps=us, schedule=sched, threads=2,
                                             **kw)
    if layer.vocab_size is not None:
        xs = [rng.integers(0, layer.vocab_size, (n, t))]
    else:
        xs = [_normal(rng, n, t, i)]
    if layer.initial_state:
        xs += [_normal(rng, layer.num_layers, n, h) for _ in range(layer.state_parts)]
    grads = layer.param_specs().keys()
    check(dev, layer, xs, exact=False)  # the gate kernels, as for the cells
    check(dev, layer, xs, accumulate=tuple(grads), seed=1, exact=False)
    # keeping everything, the CPU pipelines units on two threads; a device stays on the
    # calling thread (its current stream)
    assert workers == ([] if scheduled else [2, 2, 1, 1] * 2)
