"""The fused RNN layers' cell kernels and gate activations, alone (float32, one thread).

Times the activations inside Numba (sigmoid, tanh: nanoseconds a value over 40960 values,
the activations of one LSTM step at batch 32, hidden 256), one step's LSTM / GRU cell,
forward and backward, and one lane's LSTM forward step (the recurrent product
``W_hh @ h.T`` and the cell, over 8 steps, interleaved with the product alone), in
microseconds, medians.

    python benchmarks/speed/rnn_cell.py [--batch 32] [--hidden 256] [--repeats 2000]
"""

from __future__ import annotations

import argparse

import numpy as np
from separate_processes import alternated_median_ms, median_ms

from minidl.kernels.parallel import ensure_blas_policy
from minidl.kernels.recurrent import rnn


def _median_us(fn, repeats: int) -> float:
    return 1e3 * median_ms(fn, repeats, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    n, h, r = args.batch, args.hidden, args.repeats
    ensure_blas_policy()  # one BLAS thread, as in training (the lanes are the threads)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    values = 3 * arr(5 * n * h)
    out = np.empty_like(values)
    for name, fn in (("sigmoid", rnn.sigmoid_nb), ("tanh", rnn.tanh_nb)):
        us = _median_us(lambda fn=fn: fn(values, out), r)
        print(f"{name:8s} {1e3 * us / values.size:6.2f} ns a value ({values.size} values)")
    hw_t, gx, bias, c_prev = arr(4 * h, n), arr(n, 4 * h), arr(4 * h), arr(n, h)
    gates, hh, c = np.empty((n, 4 * h), np.float32), np.empty((n, h), np.float32), \
        np.empty((n, h), np.float32)
    dh, dc, dg, dcp, db = arr(n, h), arr(n, h), np.empty((n, 4 * h), np.float32), \
        np.empty((n, h), np.float32), np.empty(4 * h, np.float32)
    fwd = _median_us(lambda: rnn.lstm_cell_forward(hw_t, gx, bias, c_prev, gates, hh, c), r)
    bwd = _median_us(lambda: rnn.lstm_cell_backward(dh, dc, gates, c, c_prev, dg, dcp, db), r)
    print(f"LSTM cell N={n} H={h}: forward {fwd:.1f} us, backward {bwd:.1f} us")
    gx3, hw3, b3, stash = arr(n, 3 * h), arr(3 * h, n), arr(3 * h), np.empty((n, 4 * h),
                                                                               np.float32)
    dgx, dgh, db3 = np.empty((n, 3 * h), np.float32), np.empty((n, 3 * h), np.float32), \
        np.empty(3 * h, np.float32)
    fwd = _median_us(lambda: rnn.gru_cell_forward(gx3, hw3, b3, c_prev, stash, hh), r)
    bwd = _median_us(lambda: rnn.gru_cell_backward(dh, stash, c_prev, dgx, dgh, db3), r)
    print(f"GRU cell N={n} H={h}: forward {fwd:.1f} us, backward {bwd:.1f} us")
    steps = 8
    w_hh, hs, cs = 0.05 * arr(4 * h, h), np.zeros((steps + 1, n, h), np.float32), \
        np.zeros((steps + 1, n, h), np.float32)
    gxs, hw = arr(steps, n, 4 * h), np.empty((4 * h, n), np.float32)

    def lane_steps() -> None:
        for i in range(steps):
            np.matmul(w_hh, hs[i].T, out=hw)
            rnn.lstm_cell_forward(hw, gxs[i], bias, cs[i], gates, hs[i + 1], cs[i + 1])

    def products() -> None:
        for i in range(steps):
            np.matmul(w_hh, hs[i].T, out=hw)

    lane_us, product_us = (1e3 * ms / steps for ms in
                           alternated_median_ms([lane_steps, products], max(1, r // 5)))
    print(f"LSTM forward step on one lane: {lane_us:.1f} us, of which the "
          f"recurrent product {product_us:.1f} us")


if __name__ == "__main__":
    main()
