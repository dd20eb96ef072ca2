"""How far a one-process run moves from itself when its initial weights move by float32
rounding: the floor under any comparison of two exact-up-to-summation-order runs.

The model trains as ``minidl train MODEL --dataset synthetic --input 3x16x16 --width 4
--batch-size 16`` does (SGD lr 0.05, momentum 0.9, weight decay 5e-4, the same batches); a
second run starts from the same weights, each multiplied by ``1 + eps * N(0, 1)`` (with eps
1e-8 most float32 weights do not change and a few move by one ulp). Printed: the absolute
difference of the two runs' losses per step.

    python benchmarks/distributed/training_sensitivity.py [--model resnet20] [--steps 20] \
        [--eps 1e-8,1e-7]
"""

from __future__ import annotations

import argparse

import numpy as np

import minidl
from minidl.datasets.data import batches, load_dataset
from minidl.net.optim import SGD
from minidl.zoo.models import get_model


def losses(model: str, steps: int, eps: float) -> np.ndarray:
    """The losses of ``steps`` steps from the model's initial weights perturbed by ``eps``."""
    ds = load_dataset("synthetic", input_shape=(3, 16, 16))
    net = get_model(model, (3, 16, 16), 10, width=4)
    rng = np.random.default_rng(1)
    for _, p in net.named_parameters():
        p.data[...] *= (1 + eps * rng.standard_normal(p.data.shape)).astype(p.data.dtype)
    trainer = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9,
                                      weight_decay=5e-4), memory="none")
    out = []
    for xb, yb in batches(ds.x_train, ds.y_train, 16, seed=0, epoch=0):
        if len(out) == steps:
            break
        out.append(trainer.step(xb, yb))
    return np.array(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet20")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eps", default="1e-8,1e-7")
    args = ap.parse_args(argv)
    base = losses(args.model, args.steps, 0.0)
    for eps in (float(e) for e in args.eps.split(",")):
        diff = np.abs(losses(args.model, args.steps, eps) - base)
        print(f"{args.model} eps {eps:g}: " + " ".join(f"{d:.1e}" for d in diff))


if __name__ == "__main__":
    main()
