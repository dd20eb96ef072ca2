"""One 3x3 / stride-1 / pad-1 convolution layer, forward and backward, minidl against PyTorch.

For each ``N,C,HW`` (C input and output channels, HW x HW planes, no bias) minidl's kernels
(``minidl.kernels.convolution.conv``, the algorithm it chooses, or each of ``--algos``) and
PyTorch's
``nn.Conv2d`` (input gradient included) are timed; PyTorch in a process of its own
(``minidl.tools.child_process.ChildProcess``), the two alternating per round; medians in ms.
The default shapes are resnet56's at batch 128.

    python benchmarks/speed/conv_layers_torch.py [--shapes 128,16,32 128,32,16 128,64,8] \
        [--rounds 7]
"""

from __future__ import annotations

import argparse

import numpy as np
from separate_processes import median_ms, require_torch_absent

from minidl.kernels.convolution.conv import conv2d_backward, conv2d_forward
from minidl.kernels.convolution.conv_geometry import choose_algo
from minidl.tools.child_process import ChildProcess


def _minidl_ms(x, w, y, dy, dx, dw, algo: str, repeats: int) -> tuple[float, float]:
    """minidl's (forward, backward) median ms with ``algo``."""
    fwd = median_ms(lambda: conv2d_forward(x, w, None, y, padding=(1, 1), algo=algo),
                     repeats)
    bwd = median_ms(lambda: conv2d_backward(x, w, dy, dx, dw, None, padding=(1, 1),
                                             algo=algo), repeats)
    return fwd, bwd


class TorchConv:
    """PyTorch's side: built and timed in the child process."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def time(self, n: int, c: int, hw: int, repeats: int) -> tuple[float, float]:
        torch = self.torch
        conv = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
        x = torch.randn(n, c, hw, hw, requires_grad=True)
        g = torch.randn(n, c, hw, hw)

        def both():
            conv.zero_grad(set_to_none=True)
            x.grad = None
            conv(x).backward(g)

        with torch.no_grad():
            fwd = median_ms(lambda: conv(x), repeats)
        return fwd, median_ms(both, repeats) - fwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["128,16,32", "128,32,16", "128,64,8"])
    ap.add_argument("--algos", default="", help="comma-separated: gemm, winograd, winograd4")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5, help="calls timed per round")
    args = ap.parse_args()
    require_torch_absent()
    theirs = ChildProcess(TorchConv)
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        n, c, hw = (int(v) for v in shape.split(","))
        x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
        w = (rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
        y, dx, dy = np.empty_like(x), np.empty_like(x), rng.standard_normal(x.shape,
                                                                            dtype=np.float32)
        dw = np.empty_like(w)
        chosen = choose_algo(x.shape, (3, 3), (1, 1), (1, 1), 1, (1, 1), c, 4)
        algos = args.algos.split(",") if args.algos else [chosen]
        rows: dict[str, list[tuple[float, float]]] = {a: [] for a in algos}
        rows["PyTorch"] = []
        for _ in range(args.rounds):
            for a in algos:
                rows[a].append(_minidl_ms(x, w, y, dy, dx, dw, a, args.repeats))
            rows["PyTorch"].append(tuple(theirs.call("time", n, c, hw, args.repeats)))
        print(f"N={n} C={c} {hw}x{hw} (minidl chooses {chosen}): forward / backward ms")
        for name, r in rows.items():
            f, b = np.median(np.array(r), axis=0)
            print(f"  {name:10s} {f:7.2f} / {b:7.2f}")


if __name__ == "__main__":
    main()
