"""Plain VGG-11 (no BatchNorm) trained on Fashion-MNIST in 1/8 of the device memory `none`
needs: `auto` with that budget (micro-batches, convolution workspace caps, swaps) and an arena
of exactly that size. Progress lines on stderr every ``--progress-every`` steps; then one JSON
object: both peaks, the plan's notes, the loss curve, test accuracy.

    python benchmarks/measured/vgg11_eighth.py       # width 64, batch 512, 200 steps, he, SGD 0.01
    python benchmarks/measured/vgg11_eighth.py --init vgg --lr 0.05  # did not learn
    python benchmarks/measured/vgg11_eighth.py --width 16 --batch-size 64 --steps 60 --fraction 1

``--init he`` (the default): He normal with fan-in for convolutions and linear layers, zero
biases, so every layer keeps its input's scale. ``--init vgg``: torchvision's VGG
initialisation (He normal with fan-out for convolutions, N(0, 0.01) for linear layers): with
fan-out each widening convolution halves the activations' variance and the two 0.01 linear
layers shrink the logits and the gradients by ~4x each, so this 11-layer network without
BatchNorm sat at ln(10) (loss 2.302-2.304 for 40 steps at batch 64 with SGD lr 0.01,
momentum 0.9, and for 200 steps at batch 512 with lr 0.05); with ``he`` the same probe fell
to ~1.2 in 40 steps. minidl's default (PyTorch's layer default, U(+-1/sqrt(fan_in))) also
sits at ln(10) for hundreds of steps (``--init default``).
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from minidl import Network, Trainer, dry_run
from minidl.datasets import data as D
from minidl.layers import Conv2d, Linear, SoftmaxCrossEntropy
from minidl.net.optim import make_optimizer
from minidl.zoo.models import get_model

INITS = ("he", "vgg", "default")


def vgg_init(net: Network, seed: int = 0) -> None:
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


def he_init(net: Network, seed: int = 0) -> None:
    """He (Kaiming) normal initialisation with fan-in for convolutions and linear layers,
    zero biases, in place."""
    rng = np.random.default_rng(seed)
    for node in net.nodes:
        if not isinstance(node.layer, (Conv2d, Linear)):
            continue
        params = net.layer_params(node.name)
        w = params["weight"]
        fan_in = int(np.prod(w.shape[1:]))
        w.data[...] = rng.normal(0, math.sqrt(2.0 / fan_in), w.shape)
        if "bias" in params:
            params["bias"].data[...] = 0


def init_weights(net: Network, name: str, seed: int = 0) -> None:
    """Initialise ``net`` in place by ``name``: one of :data:`INITS` (``default`` keeps the
    layers' own initialisation)."""
    if name == "he":
        he_init(net, seed)
    elif name == "vgg":
        vgg_init(net, seed)
    elif name != "default":
        raise ValueError(f"unknown init {name!r}; valid: {', '.join(INITS)}")


def loss_curve(losses: list[float], every: int) -> list[dict[str, float]]:
    """Mean training loss of each window of ``every`` steps (the last window may be shorter),
    labelled by its last step."""
    return [{"step": min(i + every, len(losses)), "mean_loss": float(np.mean(losses[i:i + every]))}
            for i in range(0, len(losses), every)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=None,
                    help="default: 0.01 for sgd (momentum 0.9), 1e-3 for adam")
    ap.add_argument("--init", default="he", choices=INITS,
                    help="he: He normal fan-in (default); vgg: torchvision's VGG init")
    ap.add_argument("--clip-grad-norm", type=float, default=None,
                    help="clip the global gradient norm to this value (default: no clipping)")
    ap.add_argument("--progress-every", type=int, default=10,
                    help="a progress line on stderr and a loss-curve point every N steps")
    ap.add_argument("--fraction", type=int, default=8, help="budget = none's peak / this")
    args = ap.parse_args()
    if args.progress_every < 1:
        ap.error(f"--progress-every must be >= 1, not {args.progress_every}")
    lr = args.lr if args.lr is not None else (0.01 if args.optimizer == "sgd" else 1e-3)
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
    init_weights(net, args.init)
    opt = make_optimizer(args.optimizer, net.parameters(), lr, defaults.weight_decay)
    tr = Trainer(net, opt, memory=spec, device_memory=budget, clip_grad_norm=args.clip_grad_norm,
                 loss=SoftmaxCrossEntropy(label_smoothing=defaults.label_smoothing))
    hist = tr.fit(ds, epochs=math.ceil(args.steps * args.batch_size / len(ds.x_train)),
                  batch_size=args.batch_size, max_steps=args.steps, progress=True,
                  progress_every=args.progress_every)
    rep = tr.memory_report()
    print(json.dumps({
        "model": f"vgg11 width {args.width}", "batch_size": args.batch_size,
        "none_peak_bytes": none, "budget_bytes": budget, "device_memory_bytes": budget,
        "dry_run_peak_bytes": plan["peak_allocated_bytes"],
        "run_peak_allocated_bytes": rep["peak_allocated_bytes"],
        "run_peak_reserved_bytes": rep["peak_reserved_bytes"], "split": plan["split"],
        "notes": plan["notes"], "steps": len(hist.losses), "optimizer": args.optimizer,
        "lr": opt.lr, "init": args.init, "clip_grad_norm": args.clip_grad_norm,
        "wall_time_s": hist.wall_time_s,
        "step_time_median_s": float(np.median(hist.step_times)),
        "first_losses": hist.losses[:5], "last_losses": hist.losses[-5:],
        "loss_curve": loss_curve(hist.losses, args.progress_every),
        "test_loss": hist.test.loss, "test_accuracy": hist.test.accuracy}))


if __name__ == "__main__":
    main()
