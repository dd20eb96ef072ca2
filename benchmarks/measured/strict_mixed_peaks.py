"""Arena peaks of a training step in fp32 and mixed precision on the strict CUDA test device.

The second step's ``allocated_bytes.peak`` (reuse,inplace, SGD with momentum), the scratch
block a run reserves for CuPy's own temporaries, the mixed peak over fp32's, and whether the
dry run for the cuda kind (with that scratch) equals the run. One line per model and precision:

    python benchmarks/measured/strict_mixed_peaks.py [--batch-size 8] [--models smallcnn,...]
"""
import argparse

import numpy as np

import minidl
from minidl.memory.testing.strict_device import StrictCudaDevice
from minidl.net.optim import SGD
from minidl.zoo.models import lenet5, resnet, smallcnn
from minidl.zoo.transformers import TransformerConfig, gpt

MODELS = {
    "smallcnn": (lambda: smallcnn((1, 28, 28), 10), "images", (1, 28, 28)),
    "lenet5": (lambda: lenet5((1, 28, 28), 10), "images", (1, 28, 28)),
    "resnet20": (lambda: resnet(20, (3, 32, 32), 10), "images", (3, 32, 32)),
    "gpt": (lambda: gpt(TransformerConfig(2, 4, 64, 64, 65, dropout=0.0)), "tokens", (64,)),
    "gpt-dropout": (lambda: gpt(TransformerConfig(2, 4, 64, 64, 65, dropout=0.1)), "tokens",
                    (64,)),
}


def batch(kind, shape, n):
    rng = np.random.default_rng(0)
    if kind == "images":
        return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 10, n)
    x = rng.integers(0, 65, (n, *shape))
    return x, np.roll(x, -1, axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    for name in args.models.split(","):
        make, kind, shape = MODELS[name]
        x, y = batch(kind, shape, args.batch_size)
        fp32 = None
        for precision in ("fp32", "bf16-mixed", "fp16-mixed"):
            net = make()
            tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                                memory="reuse,inplace", device=StrictCudaDevice("1GiB"),
                                device_memory="1GiB", precision=precision)
            tr.step(x, y)
            tr.pool.reset_peak_stats()
            tr.step(x, y)
            peak = tr.pool.stats()["allocated_bytes.peak"]
            scratch = tr.engine.scratch.size if tr.engine.scratch is not None else 0
            fp32 = peak if fp32 is None else fp32
            dry = minidl.dry_run(make(), args.batch_size, "reuse,inplace", input_shape=shape,
                                 device_kind="cuda", precision=precision,
                                 scratch_bytes=scratch)["peak_allocated_bytes"]
            print(f"{name} b{args.batch_size} {precision:10s} peak {peak:>12,d} B  scratch "
                  f"{scratch:>9,d} B  {peak / fp32:.3f}x fp32  dry run "
                  f"{'equal' if dry == peak else f'DIFFERENT ({dry:,d})'}", flush=True)


if __name__ == "__main__":
    main()
