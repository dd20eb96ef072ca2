"""Plain VGG-11 (no BatchNorm) trained on Fashion-MNIST in 1/8 of the device memory `none`
needs: `auto` with that budget (micro-batches, convolution workspace caps, swaps) and an arena
of exactly that size. One JSON object: both peaks, the plan's notes, losses, test accuracy.

    python benchmarks/vgg11_eighth.py                         # width 64, batch 512, 200 steps
    python benchmarks/vgg11_eighth.py --width 16 --batch-size 64 --steps 60 --fraction 1

The convolutions and linear layers start from torchvision's VGG initialisation (He normal,
fan-out, for convolutions; N(0, 0.01) for linear layers; zero biases): from minidl's default
(PyTorch's layer default, U(+-1/sqrt(fan_in))) this 11-layer network without BatchNorm sits at
ln(10) for hundreds of steps (with SGD and with Adam; measured with `minidl train vgg11`).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
from minidl.layers import Conv2d, Linear, SoftmaxCrossEntropy

from minidl import Trainer, dry_run
from minidl import data as D
from minidl.models import get_model
from minidl.optim import make_optimizer


def vgg_init(net, seed: int = 0) -> None:
    """torchvision's VGG initialisation, in place."""
    rng = np.random.default_rng(seed)
    for node in net.nodes:
        params = net.layer_params(node.name)
        if isinstance(node.layer, Conv2d):
            w = params["weight"]
            fan_out = w.shape[0] * w.shape[2] * w.shape[3]
            w.data[...] = rng.normal(0, math.sqrt(2.0 / fan_out), w.shape)
        elif isinstance(node.layer, Linear):
            params["weight"].data[...] = rng.normal(0, 0.01, params["weight"].shape)
        else:
            continue
        if "bias" in params:
            params["bias"].data[...] = 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--fraction", type=int, default=8, help="budget = none's peak / this")
    args = ap.parse_args()
    defaults = D.train_defaults("fashion-mnist")
    ds = D.load_dataset("fashion-mnist")
    if defaults.standardize:
        ds.standardize()

    def make():
        return get_model("vgg11", ds.input_shape, ds.num_classes, width=args.width)

    none = dry_run(make(), args.batch_size, "none", optimizer=args.optimizer,
                   input_shape=ds.input_shape)["peak_allocated_bytes"]
    budget = none // args.fraction
    spec = f"auto,budget={budget}"
    plan = dry_run(make(), args.batch_size, spec, optimizer=args.optimizer,
                   input_shape=ds.input_shape)
    net = make()
    vgg_init(net)
    opt = make_optimizer(args.optimizer, net.parameters(), args.lr, defaults.weight_decay)
    tr = Trainer(net, opt, memory=spec, device_memory=budget,
                 loss=SoftmaxCrossEntropy(label_smoothing=defaults.label_smoothing))
    hist = tr.fit(ds, epochs=math.ceil(args.steps * args.batch_size / len(ds.x_train)),
                  batch_size=args.batch_size, max_steps=args.steps, progress=False)
    rep = tr.memory_report()
    print(json.dumps({
        "model": f"vgg11 width {args.width}", "batch_size": args.batch_size,
        "none_peak_bytes": none, "budget_bytes": budget, "device_memory_bytes": budget,
        "dry_run_peak_bytes": plan["peak_allocated_bytes"],
        "run_peak_allocated_bytes": rep["peak_allocated_bytes"],
        "run_peak_reserved_bytes": rep["peak_reserved_bytes"], "split": plan["split"],
        "notes": plan["notes"], "steps": len(hist.losses), "optimizer": args.optimizer,
        "lr": opt.lr, "wall_time_s": hist.wall_time_s,
        "step_time_median_s": float(np.median(hist.step_times)),
        "first_losses": hist.losses[:5], "last_losses": hist.losses[-5:],
        "test_loss": hist.test_loss, "test_accuracy": hist.test_accuracy}))


if __name__ == "__main__":
    main()
