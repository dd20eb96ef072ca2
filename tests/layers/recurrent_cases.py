"""What the fused LSTM / GRU tests share: the cells, their inputs and schedules, and one
forward and backward run as the engine runs them on NaN-filled buffers."""

from __future__ import annotations

import numpy as np
from gradcheck import Result, make_inputs
from hypothesis import strategies as st

from minidl.layers import GRU, LSTM, Context
from minidl.memory.passes import bptt

CELLS = {"lstm": LSTM, "gru": GRU}
cells = st.sampled_from(sorted(CELLS))
seeds = st.integers(0, 2**32 - 1)


def _make(cell, i, h, layers=1, bias=True, **kw):
    kw.setdefault("dtype", np.float64)
    return CELLS[cell](i, h, layers, bias, **kw)


def _in_shapes(layer, n, t):
    x = (n, t) if layer.vocab_size is not None else (n, t, layer.input_size)
    state = (layer.num_layers, n, layer.hidden_size)
    return [x] + ([state] * layer.state_parts if layer.initial_state else [])


def _inputs(layer, n, t, rng, dtype=np.float64):
    ints = {0: layer.vocab_size} if layer.vocab_size is not None else None
    return make_inputs(layer, _in_shapes(layer, n, t), rng, dtype=dtype, int_inputs=ints)


def _vocab_for(path, n, t):
    """A vocabulary size that sends token input down the (V, G) table path (V <= N*T) or the
    gather-then-GEMM path (V > N*T)."""
    return max(1, (n * t) // 2) if path == "table" else n * t + 3


def _units(t, unit_steps):
    return -(-t // unit_steps)


def _schedule(kind, units, slots):
    if kind == "all":
        return bptt.store_all_schedule(units)
    if kind == "sqrt":
        return bptt.sqrt_schedule(units)
    if kind == "dp":
        return bptt.dp_schedule(units, slots)
    return bptt.schedule_for_budget(units, slots)


def _run(layer, inputs, params, gy, need=None):
    """Forward then backward as the engine runs them, on fresh NaN-filled outputs, stash,
    gradients and workspaces (0xFF bytes: NaN in float32 and float64, so a read of anything
    not written first poisons the results). Returns gradcheck's ``Result``."""
    inputs = [np.array(x, copy=True) for x in inputs]
    params = {k: np.array(v, copy=True) for k, v in params.items()}
    shapes = [tuple(x.shape) for x in inputs]
    dtype = np.dtype(layer.output_dtypes([x.dtype for x in inputs])[0])
    (out_shape,) = layer.output_shapes(shapes)

    def nan(shape, dt=dtype):
        return np.full(shape, np.nan, dt)

    def workspace(nbytes):
        return np.full(nbytes, 0xFF, np.uint8) if nbytes else None

    y = nan(out_shape)
    stash = {k: nan(s, d) for k, (s, d) in layer.stash_specs(shapes, dtype).items()}
    layer.forward(Context(), inputs, [y], params, stash,
                  workspace(layer.forward_workspace_bytes(shapes, dtype)))
    assert layer.retain_inputs == tuple(range(len(inputs))) and not layer.retain_outputs
    need = need or [True] * len(inputs)
    gin = [None if (i in layer.nondiff_inputs or not need[i]) else nan(x.shape, x.dtype)
           for i, x in enumerate(inputs)]
    gp = {k: nan(v.shape) for k, v in params.items()}
    layer.backward(Context(), [np.array(gy, copy=True)], gin, inputs, [None], params, gp, stash,
                   workspace(layer.backward_workspace_bytes(shapes, dtype)))
    return Result([y], stash, gin, gp, params)
