"""LSTM and GRU cell kernels for device arrays: one Numba CUDA kernel per cell and direction.

The CPU kernels (:mod:`minidl.kernels.recurrent.rnn`) run one Numba loop per step on the host; on a
GPU
each array operation is a kernel launch, and a cell written as ufuncs made ~30 of them per step
and layer. Here one launch computes a whole step's gate math, one thread per (row, hidden
unit) ``(n, j)`` computing all the gates of that unit (grid-stride loops over ``N * H``; reads
and writes of a gate block are coalesced along ``j``). The recurrent GEMMs stay with the
callers (cuBLAS through ``np.matmul(..., out=)``).

Same formulas, gate orders and PyTorch layouts as the CPU kernels, and the same association of
every sum and product (the pre-activations ``hw + gx + bias`` are the CPU's bits for the same
GEMM result). The activations differ: ``math.exp`` / ``math.tanh`` of the array's dtype
(CUDA's ``expf`` / ``tanhf`` in float32, a few ulp) instead of the CPU's own exp, and NVVM may
contract a multiply-add into an FMA, so results agree with the CPU to float32 rounding (well
within ``rtol=1e-5``), not bit for bit. Each output element is computed by one thread from its
own inputs: results are deterministic. All scalars arrive in the array dtype (``one``), so
float32 math stays float32.

What each kernel takes beyond the CPU cell:

* the recurrent product ``hw`` either row-major ``(N, G)`` (``h_prev @ W_hh.T``, coalesced; the
  fused layers) or gate-major ``(G, N)`` (``W_hh @ h_prev.T``, the CPU layout; the per-step
  cell layers), flag ``gate_major``;
* biases as the callers hold them: LSTM adds ``bias_terms`` of them (0: none, 1: ``b_a``, 2:
  ``b_a + b_b``, summed first as the CPU's ``b_ih + b_hh`` buffer is); GRU adds ``b_ih`` to
  ``gx`` (as the CPU adds it to the projection) and ``b_hh`` to the product, each optional;
* backward adds the carried ``dh`` of the next step (``carry``) to the incoming gradient in
  the kernel (the CPU's ``dh += carry``); LSTM reads ``dc`` and writes ``dc_prev`` in place
  (they may be one array); GRU's direct path ``dh * z`` into ``dh_prev`` (added after the
  ``dG_hh @ W_hh`` product) can be written to ``direct_out`` and read back by the kernel of
  the step before as ``direct_in``, which saves the separate addition per step.

Per-step bias sums (the CPU kernels' ``dbias``) are not computed: the fused layers sum ``dG``
once per unit; :func:`minidl.kernels.recurrent.rnn.lstm_cell_backward` (the cell layers) sums it
with one
reduction.

Kernels are written as in :mod:`minidl.kernels._cuda` (module global ``cuda``, grid-stride
loops, no integer ``min`` / ``max``); emulated device arrays run them as one host thread.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ---------------------------------------------------------------- CUDA kernels
def _k_lstm_fwd(hw, gate_major, gx, b_a, b_b, bias_terms, c_prev, gates, h, c, one):
    n_rows, hid = h.shape
    for t in range(cuda.grid(1), n_rows * hid, cuda.gridsize(1)):
        n = t // hid
        j = t - n * hid
        pre_i = (hw[j, n] if gate_major else hw[n, j]) + gx[n, j]
        pre_f = (hw[hid + j, n] if gate_major else hw[n, hid + j]) + gx[n, hid + j]
        pre_g = (hw[2 * hid + j, n] if gate_major else hw[n, 2 * hid + j]) + gx[n, 2 * hid + j]
        pre_o = (hw[3 * hid + j, n] if gate_major else hw[n, 3 * hid + j]) + gx[n, 3 * hid + j]
        if bias_terms == 1:
            pre_i += b_a[j]
            pre_f += b_a[hid + j]
            pre_g += b_a[2 * hid + j]
            pre_o += b_a[3 * hid + j]
        elif bias_terms == 2:
            pre_i += b_a[j] + b_b[j]
            pre_f += b_a[hid + j] + b_b[hid + j]
            pre_g += b_a[2 * hid + j] + b_b[2 * hid + j]
            pre_o += b_a[3 * hid + j] + b_b[3 * hid + j]
        i_ = one / (one + math.exp(-pre_i))
        f_ = one / (one + math.exp(-pre_f))
        g_ = math.tanh(pre_g)
        o_ = one / (one + math.exp(-pre_o))
        gates[n, j] = i_
        gates[n, hid + j] = f_
        gates[n, 2 * hid + j] = g_
        gates[n, 3 * hid + j] = o_
        cc = f_ * c_prev[n, j] + i_ * g_
        c[n, j] = cc
        h[n, j] = o_ * math.tanh(cc)


def _k_lstm_bwd(dh, carry, has_carry, dc, gates, c, c_prev, one, dgates, dc_prev,
                write_dc_prev):
    n_rows, hid = c.shape
    for t in range(cuda.grid(1), n_rows * hid, cuda.gridsize(1)):
        n = t // hid
        j = t - n * hid
        d_h = dh[n, j] + carry[n, j] if has_carry else dh[n, j]
        i_ = gates[n, j]
        f_ = gates[n, hid + j]
        g_ = gates[n, 2 * hid + j]
        o_ = gates[n, 3 * hid + j]
        tc = math.tanh(c[n, j])
        dct = dc[n, j] + d_h * o_ * (one - tc * tc)
        dgates[n, 3 * hid + j] = d_h * tc * (o_ * (one - o_))
        dgates[n, j] = dct * g_ * (i_ * (one - i_))
        dgates[n, hid + j] = dct * c_prev[n, j] * (f_ * (one - f_))
        dgates[n, 2 * hid + j] = dct * i_ * (one - g_ * g_)
        if write_dc_prev:
            dc_prev[n, j] = dct * f_


def _k_gru_fwd(gx, b_ih, has_b_ih, hw, gate_major, b_hh, has_b_hh, h_prev, stash, h, one):
    n_rows, hid = h.shape
    for t in range(cuda.grid(1), n_rows * hid, cuda.gridsize(1)):
        n = t // hid
        j = t - n * hid
        hr = hw[j, n] if gate_major else hw[n, j]
        hz = hw[hid + j, n] if gate_major else hw[n, hid + j]
        ghn = hw[2 * hid + j, n] if gate_major else hw[n, 2 * hid + j]
        if has_b_hh:
            hr += b_hh[j]
            hz += b_hh[hid + j]
            ghn += b_hh[2 * hid + j]
        xr = gx[n, j]
        xz = gx[n, hid + j]
        xn = gx[n, 2 * hid + j]
        if has_b_ih:
            xr += b_ih[j]
            xz += b_ih[hid + j]
            xn += b_ih[2 * hid + j]
        r = one / (one + math.exp(-(xr + hr)))
        z = one / (one + math.exp(-(xz + hz)))
        nn = math.tanh(xn + r * ghn)
        stash[n, j] = r
        stash[n, hid + j] = z
        stash[n, 2 * hid + j] = nn
        stash[n, 3 * hid + j] = ghn
        h[n, j] = nn + z * (h_prev[n, j] - nn)


def _k_gru_bwd(dh, carry, has_carry, direct_in, has_direct_in, stash, h_prev, one, dgx, dgh,
               direct_out, write_direct):
    n_rows, hid = h_prev.shape
    for t in range(cuda.grid(1), n_rows * hid, cuda.gridsize(1)):
        n = t // hid
        j = t - n * hid
        d_h = dh[n, j]
        if has_carry:  # dh + (dG_hh @ W_hh + dh_next * z_next), summed as the CPU sums it
            d_h = d_h + (carry[n, j] + direct_in[n, j] if has_direct_in else carry[n, j])
        r = stash[n, j]
        z = stash[n, hid + j]
        nn = stash[n, 2 * hid + j]
        dn = d_h * (one - z) * (one - nn * nn)
        dz = d_h * (h_prev[n, j] - nn) * (z * (one - z))
        dr = dn * stash[n, 3 * hid + j] * (r * (one - r))
        dgx[n, j] = dr
        dgx[n, hid + j] = dz
        dgx[n, 2 * hid + j] = dn
        dgh[n, j] = dr
        dgh[n, hid + j] = dz
        dgh[n, 2 * hid + j] = dn * r
        if write_direct:
            direct_out[n, j] = d_h * z


def _k_gru_add_direct(acc, dh, stash):
    n_rows, hid = acc.shape
    for t in range(cuda.grid(1), n_rows * hid, cuda.gridsize(1)):
        n = t // hid
        j = t - n * hid
        acc[n, j] += dh[n, j] * stash[n, hid + j]


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_lstm_fwd", "_k_lstm_bwd", "_k_gru_fwd", "_k_gru_bwd",
                                  "_k_gru_add_direct"])


# ---------------------------------------------------------------- entry points
def device_ok(*arrays: Any) -> bool:
    """True when the kernels here apply: device arrays (``None`` entries skipped), 1-D or
    C-contiguous, all of one float32 / float64 dtype."""
    present = [a for a in arrays if a is not None]
    if not present or not all(_cuda.is_device_array(a) for a in present):
        return False
    dtype = np.dtype(present[0].dtype)
    return dtype in _DTYPES and all(
        np.dtype(a.dtype) == dtype and a.flags.c_contiguous for a in present)


def _one(a: Any) -> Any:
    return np.dtype(a.dtype).type(1)


def lstm_forward_device(hw: Any, gx: Any, bias_a: Any, bias_b: Any, c_prev: Any, gates: Any,
                        h: Any, c: Any, *, gate_major: bool) -> None:
    """One LSTM step's gate math in one launch: ``pre = hw + gx (+ bias_a (+ bias_b))``, gates
    ``[i, f, g, o]`` into ``gates`` (N, 4H), ``c = f*c_prev + i*g``, ``h = o*tanh(c)``.

    ``hw`` is the recurrent product, (N, 4H) or gate-major (4H, N) (``gate_major``); ``bias_a``
    / ``bias_b`` (4H,) may be None (no bias, or one)."""
    terms = 0 if bias_a is None else (1 if bias_b is None else 2)
    b_a = _cuda.flat(h) if bias_a is None else bias_a  # (a 1-D stand-in, never read)
    b_b = b_a if bias_b is None else bias_b
    _cuda.launch(_kernels().k_lstm_fwd, h.size, hw, bool(gate_major), gx, b_a, b_b, terms,
                 c_prev, gates, h, c, _one(h))


def lstm_backward_device(dh: Any, carry: Any, dc: Any, gates: Any, c: Any, c_prev: Any,
                         dgates: Any, dc_prev: Any) -> None:
    """Gradients of one LSTM step in one launch: ``dgates`` (N, 4H) from ``dh (+ carry)`` and
    ``dc``; ``dc_prev`` (unless None; may be ``dc`` itself) = ``dc_total * f``. No bias sums."""
    write = dc_prev is not None
    _cuda.launch(_kernels().k_lstm_bwd, c.size, dh, dh if carry is None else carry,
                 carry is not None, dc, gates, c, c_prev, _one(c), dgates,
                 dc_prev if write else dc, write)


def gru_forward_device(gx: Any, bias_ih: Any, hw: Any, bias_hh: Any, h_prev: Any, stash: Any,
                       h: Any, *, gate_major: bool) -> None:
    """One GRU step's gate math in one launch: ``h`` (N, H) and ``stash`` (N, 4H) = ``[r, z,
    n, W_hn h_prev + b_hn]``. ``gx`` (N, 3H) is the input projection, to which ``bias_ih``
    (unless None) is added; ``hw`` the recurrent product, (N, 3H) or gate-major (3H, N), to
    which ``bias_hh`` (unless None) is added."""
    unused = _cuda.flat(h)  # a 1-D stand-in for an absent bias, never read
    _cuda.launch(_kernels().k_gru_fwd, h.size, gx, unused if bias_ih is None else bias_ih,
                 bias_ih is not None, hw, bool(gate_major), unused if bias_hh is None else bias_hh,
                 bias_hh is not None, h_prev, stash, h, _one(h))


def gru_backward_device(dh: Any, carry: Any, direct_in: Any, stash: Any, h_prev: Any,
                        dgx: Any, dgh: Any, direct_out: Any) -> None:
    """Gradients of one GRU step in one launch: ``dgx``, ``dgh`` (N, 3H) from ``dh`` plus,
    unless None, ``carry`` (``dG_hh @ W_hh`` of the next step) and ``direct_in`` (its ``dh *
    z``, needs ``carry``); ``direct_out`` (unless None; may be ``dh`` itself) = this step's
    ``dh_total * z``. No bias sums."""
    has_carry = carry is not None
    has_direct = has_carry and direct_in is not None
    write = direct_out is not None
    _cuda.launch(_kernels().k_gru_bwd, h_prev.size, dh, carry if has_carry else dh, has_carry,
                 direct_in if has_direct else dh, has_direct, stash, h_prev, _one(h_prev), dgx,
                 dgh, direct_out if write else dh, write)


def gru_add_direct_device(acc: Any, dh: Any, stash: Any) -> None:
    """``acc += dh * z`` (z = ``stash[:, H:2H]``) in one launch."""
    _cuda.launch(_kernels().k_gru_add_direct, acc.size, acc, dh, stash)
