"""The fused LSTM's per-step recurrent products: NumPy's BLAS against a register-blocked
kernel of our own (float32, one thread, interleaved call by call in one process, medians).

Question asked (Part 17, char-lstm): OpenBLAS packs the 1 MB ``W_hh`` at every call of a
32-column product; would a kernel that reads ``W_hh`` in place, with the same FMA panel an
optimised GEMM uses, run the step's products faster? The kernel here is a 6 x 16 panel
(twelve 8-float accumulators, written as LLVM IR so that they stay in the 16 AVX2 registers),
optionally blocked over the inner dimension so that the streamed operand stays in L1. It is
an experiment, not used by minidl. Prints, in microseconds:

- forward ``hw_t = W_hh @ h.T`` (4H x N): BLAS (what the layers run) and the panel kernel
  (``h.T`` packed once per call, included), unblocked and blocked by 128 and 64;
- backward ``carry = dG @ W_hh`` (N x H): BLAS and the panel kernel;
- the FMA peak of one core (the panel on operands held in registers), in GFLOP/s.

    python benchmarks/speed/recurrent_product.py [--batch 32] [--hidden 256] [--repeats 600]

Needs an x86-64 CPU with AVX2 and FMA.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from separate_processes import alternated_median_ms

from minidl.kernels.parallel import ensure_blas_policy

ROWS, VECTORS, LANES = 6, 2, 8  # the panel: 6 rows x 2 vectors of 8 floats


@intrinsic
def _panel(typingctx, a, a_at, a_row, a_inner, b, b_at, b_inner, c, c_at, c_row, depth, add):
    """``c[r, 0:16] (+)= sum_k a[r, k] * b[k, 0:16]`` for r < 6, addressed in elements of the
    flat float32 arrays (``a`` broadcast one value at a time, ``b`` read as vectors); one
    fused multiply-add per term in ascending k (blocking over k therefore keeps the bits)."""
    sig = types.void(a, a_at, a_row, a_inner, b, b_at, b_inner, c, c_at, c_row, depth, add)

    def codegen(context, builder, signature, args):
        a_, a_at_, a_row_, a_inner_, b_, b_at_, b_inner_, c_, c_at_, c_row_, depth_, add_ = args
        f32, i64 = ir.FloatType(), ir.IntType(64)
        vec = ir.VectorType(f32, LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                             "llvm.fma.v8f32")

        def base(value, ty, at):
            return builder.gep(context.make_array(ty)(context, builder, value).data, [at])

        pa = base(a_, signature.args[0], a_at_)
        pb = base(b_, signature.args[4], b_at_)
        pc = base(c_, signature.args[7], c_at_)

        def c_slot(r, v):
            at = builder.add(builder.mul(ir.Constant(i64, r), c_row_), ir.Constant(i64, 8 * v))
            return builder.bitcast(builder.gep(pc, [at]), vec.as_pointer())

        zero = ir.Constant(vec, [0.0] * LANES)
        start = [[builder.select(add_, builder.load(c_slot(r, v), align=4), zero)
                  for v in range(VECTORS)] for r in range(ROWS)]
        entry = builder.block
        loop = builder.append_basic_block("panel_loop")
        done = builder.append_basic_block("panel_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(ir.Constant(i64, 0), entry)
        acc = [[builder.phi(vec) for _ in range(VECTORS)] for _ in range(ROWS)]
        for r in range(ROWS):
            for v in range(VECTORS):
                acc[r][v].add_incoming(start[r][v], entry)
        b_k = builder.mul(k, b_inner_)
        b_vec = [builder.load(builder.bitcast(
            builder.gep(pb, [builder.add(b_k, ir.Constant(i64, 8 * v))]), vec.as_pointer()),
            align=4) for v in range(VECTORS)]
        a_k = builder.mul(k, a_inner_)
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
        new = []
        for r in range(ROWS):
            value = builder.load(builder.gep(
                pa, [builder.add(a_k, builder.mul(ir.Constant(i64, r), a_row_))]))
            one = builder.insert_element(ir.Constant(vec, ir.Undefined), value,
                                         ir.Constant(ir.IntType(32), 0))
            splat = builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), lanes0)
            new.append([builder.call(fma, [splat, b_vec[v], acc[r][v]])
                        for v in range(VECTORS)])
        k_next = builder.add(k, ir.Constant(i64, 1))
        k.add_incoming(k_next, builder.block)
        for r in range(ROWS):
            for v in range(VECTORS):
                acc[r][v].add_incoming(new[r][v], builder.block)
        builder.cbranch(builder.icmp_signed("<", k_next, depth_), loop, done)
        builder.position_at_end(done)
        for r in range(ROWS):
            for v in range(VECTORS):
                builder.store(new[r][v], c_slot(r, v), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True)
def _plain_rows(a, b, out, first):
    """``out[r] = a[r] @ b`` for the rows from ``first`` on (those no whole panel covers), a
    term at a time in ascending k like the panel."""
    for r in range(first, out.shape[0]):
        row = out[r]
        row[:] = 0
        for k in range(a.shape[1]):
            ak, bk = a[r, k], b[k]
            for j in range(row.size):
                row[j] += ak * bk[j]


@njit(nogil=True)
def panel_forward(w, h_t, out, block):
    """``out (G, N) = w (G, K) @ h_t (K, N)`` (N % 16 == 0), inner dimension in blocks of
    ``block`` (outermost, so a block of ``h_t`` stays in L1); the last G % 6 rows in a
    plain loop, in the same order of terms."""
    g_rows, depth = w.shape
    n = h_t.shape[1]
    whole = g_rows - g_rows % ROWS
    wf, hf, of = w.reshape(-1), h_t.reshape(-1), out.reshape(-1)
    for k0 in range(0, depth, block):
        kb = min(block, depth - k0)
        for g in range(0, whole, ROWS):
            for j in range(0, n, 16):
                if k0 == 0:  # (a literal flag: a run-time one halves the panel's rate)
                    _panel(wf, g * depth, depth, 1, hf, j, n, of, g * n + j, n, kb, False)
                else:
                    _panel(wf, g * depth + k0, depth, 1, hf, k0 * n + j, n, of, g * n + j, n,
                           kb, True)
    _plain_rows(w, h_t, out, whole)


@njit(nogil=True)
def panel_backward(dg, w, out):
    """``out (N, H) = dg (N, G) @ w (G, H)`` (H % 16 == 0); the last N % 6 rows in a plain
    loop."""
    n, depth = dg.shape
    hid = out.shape[1]
    whole = n - n % ROWS
    df, wf, of = dg.reshape(-1), w.reshape(-1), out.reshape(-1)
    for j in range(0, hid, 16):
        for r in range(0, whole, ROWS):
            _panel(df, r * depth, depth, 1, wf, j, hid, of, r * hid + j, hid, depth, False)
    _plain_rows(dg, w, out, whole)


@njit(nogil=True)
def _spin(a, b, c, depth):
    _panel(a, 0, 1, 0, b, 0, 0, c, 0, 16, depth, False)


def _interleaved(first, second, repeats):
    """Medians (us) of two calls alternated call by call."""
    return tuple(1e3 * ms for ms in alternated_median_ms([first, second], repeats, warmup=20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=600)
    args = ap.parse_args()
    n, hid, reps = args.batch, args.hidden, args.repeats
    if n % 16 or hid % 16:  # the panels' columns
        raise SystemExit(f"--batch {n} / --hidden {hid}: both must be multiples of 16")
    ensure_blas_policy()  # one BLAS thread, as on the training lanes
    rng = np.random.default_rng(0)
    gates = 4 * hid
    w = rng.standard_normal((gates, hid)).astype(np.float32)
    h = rng.standard_normal((n, hid)).astype(np.float32)
    h_t = np.empty((hid, n), np.float32)
    blas_out, own_out = np.empty((gates, n), np.float32), np.empty((gates, n), np.float32)
    flops = 2 * n * gates * hid

    def own(block):
        np.copyto(h_t, h.T)
        panel_forward(w, h_t, own_out, block)

    own(hid)
    np.matmul(w, h.T, out=blas_out)
    err = float(np.abs(own_out - blas_out).max() / np.abs(blas_out).max())
    print(f"forward W_hh @ h.T ({gates}x{hid} @ {hid}x{n}), relative difference {err:.1e}:")
    for block in (hid, 128, 64):
        blas_us, own_us = _interleaved(lambda: np.matmul(w, h.T, out=blas_out),
                                       lambda block=block: own(block), reps)
        print(f"  BLAS {blas_us:7.1f} us ({flops / blas_us / 1e3:5.1f} GFLOP/s)   "
              f"panel, inner blocks of {block:3d}: {own_us:7.1f} us "
              f"({flops / own_us / 1e3:5.1f} GFLOP/s)  ratio {own_us / blas_us:.3f}")
    dg = rng.standard_normal((n, gates)).astype(np.float32)
    blas_c, own_c = np.empty((n, hid), np.float32), np.empty((n, hid), np.float32)
    panel_backward(dg, w, own_c)
    np.matmul(dg, w, out=blas_c)
    err = float(np.abs(own_c - blas_c).max() / np.abs(blas_c).max())
    blas_us, own_us = _interleaved(lambda: np.matmul(dg, w, out=blas_c),
                                   lambda: panel_backward(dg, w, own_c), reps)
    print(f"backward dG @ W_hh ({n}x{gates} @ {gates}x{hid}), relative difference {err:.1e}:")
    print(f"  BLAS {blas_us:7.1f} us ({flops / blas_us / 1e3:5.1f} GFLOP/s)   "
          f"panel: {own_us:7.1f} us ({flops / own_us / 1e3:5.1f} GFLOP/s)"
          f"  ratio {own_us / blas_us:.3f}")
    a, b, c = np.ones(8, np.float32), np.ones(16, np.float32), np.zeros(96, np.float32)
    depth = 2_000_000
    _spin(a, b, c, 10)
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        _spin(a, b, c, depth)
        rates.append(2 * ROWS * VECTORS * LANES * depth / (time.perf_counter() - t0) / 1e9)
    print(f"FMA peak of one core (panel on registers): {max(rates):.1f} GFLOP/s")


if __name__ == "__main__":
    main()
