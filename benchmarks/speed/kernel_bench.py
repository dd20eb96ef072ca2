"""Bandwidth of the codec kernels (bitpack, sparse, precision) against ``np.copyto``.

Every figure is bytes of the dense float32 tensor per second (64 MiB by default): the input of
encoders, the output of decoders. Each round times ``np.copyto`` of the same array right before
each kernel (interleaved), and the ratio is the median over rounds of ``t_copyto / t_kernel``,
so slow drifts of a shared machine cancel. Targets (issue 7): pack >= 0.8x, ReLU backward
from the mask >= 0.8x, sparse encode at 70% zeros >= 0.5x.

    python benchmarks/speed/kernel_bench.py [--mib 64] [--rounds 11] [--zeros 0.7] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numba
import numpy as np

from minidl.kernels.codecs import bitpack, precision, sparse

TARGETS = {"pack_sign": 0.8, "relu_backward_packed": 0.8, "encode zvc": 0.5, "encode csr": 0.5}


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of the float32 array")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--zeros", type=float, default=0.7, help="fraction of zeros (ReLU output)")
    ap.add_argument("--threads", type=int, default=None, help="numba.set_num_threads")
    a = ap.parse_args()
    if a.threads:
        numba.set_num_threads(a.threads)
    n = a.mib * 2**20 // 4
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal(n, dtype=np.float32))
    x[rng.random(n) < a.zeros] = 0  # a ReLU output with the requested sparsity
    dy = rng.standard_normal(n, dtype=np.float32)
    dst, out = np.empty_like(x), np.empty_like(x)
    mask = np.empty(bitpack.packed_nbytes(n), np.uint8)
    bitpack.pack_sign(x, mask)
    nnz = sparse.count_nonzero(x)
    bufs = {f: np.empty(sparse.encoded_nbytes(n, nnz, f), np.uint8) for f in ("zvc", "csr")}
    codes = {f: np.empty(precision.encoded_nbytes(n, f), np.uint8) for f in precision.FORMATS}
    for f in bufs:
        sparse.encode(x, bufs[f], f)
    for f in codes:
        precision.encode(dy, f, codes[f])
    ops: dict[str, Callable[[], object]] = {
        "np.packbits(x > 0)": lambda: np.packbits(x > 0, bitorder="little"),
        "pack_sign": lambda: bitpack.pack_sign(x, mask),
        "unpack_sign -> float32": lambda: bitpack.unpack_sign(mask, n, out),
        "relu_backward_packed": lambda: bitpack.relu_backward_packed(dy, mask, out),
        "relu_backward_packed in place": lambda: bitpack.relu_backward_packed(out, mask, out),
        "count_nonzero": lambda: sparse.count_nonzero(x),
        "encode zvc": lambda: sparse.encode(x, bufs["zvc"], "zvc"),
        "encode csr": lambda: sparse.encode(x, bufs["csr"], "csr"),
        "decode zvc": lambda: sparse.decode(bufs["zvc"], out),
        "decode csr": lambda: sparse.decode(bufs["csr"], out),
    }
    for f in precision.FORMATS:
        ops[f"encode {f}"] = lambda f=f: precision.encode(dy, f, codes[f])
        ops[f"decode {f}"] = lambda f=f: precision.decode(codes[f], f, out)
    for fn in ops.values():  # compile / load from cache, touch pages
        fn()
    base: list[float] = []
    t = {k: [] for k in ops}
    r = {k: [] for k in ops}
    for _ in range(a.rounds):
        for k, fn in ops.items():
            tc = _time(lambda: np.copyto(dst, x))
            tk = _time(fn)
            base.append(tc)
            t[k].append(tk)
            r[k].append(tc / tk)
    gb = x.nbytes / 1e9
    print(f"{a.mib} MiB float32 ({n} elements), {a.zeros:.0%} zeros (nnz={nnz}), "
          f"{a.rounds} rounds, numba threads {numba.get_num_threads()} "
          f"({numba.threading_layer()}), load average {os.getloadavg()[0]:.2f}")
    print("median ms and GB/s; x copyto = median of per-round ratios; best = fastest round")
    print(f"{'kernel':32s} {'ms':>8s} {'GB/s':>7s} {'x copyto':>9s} {'best GB/s':>10s}  target")
    print(f"{'np.copyto (baseline)':32s} {np.median(base) * 1e3:8.2f} "
          f"{gb / np.median(base):7.2f} {1:9.2f} {gb / min(base):10.2f}")
    for k in ops:
        m, ratio = float(np.median(t[k])), float(np.median(r[k]))
        goal = TARGETS.get(k)
        verdict = "" if goal is None else f">= {goal}: {'ok' if ratio >= goal else 'MISSED'}"
        print(f"{k:32s} {m * 1e3:8.2f} {gb / m:7.2f} {ratio:9.2f} {gb / min(t[k]):10.2f}  "
              f"{verdict}")


if __name__ == "__main__":
    main()
