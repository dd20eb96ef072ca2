"""smallcnn forward+backward: minidl's Conv2d / ReLU / MaxPool2d against PyTorch CPU.

conv3x3(1->32, pad 1) -> ReLU -> MaxPool2 -> conv3x3(32->64, pad 1) -> ReLU -> MaxPool2 ->
Flatten -> Linear(3136->10) -> softmax cross-entropy, batch 64, 1x28x28, float32.

The minidl side calls the layers' ``forward`` / ``backward`` directly on preallocated
buffers, as the engine does (no engine, no optimizer); Flatten, Linear and the loss are plain
NumPy here. The PyTorch side (the same network, forward + backward, no optimizer) lives in a
process of its own (``minidl.tools.child_process.ChildProcess``): torch is never imported in the
process that times minidl (checked), since each runtime's idle threads spinning after its work
slow the other. Both start from the same weights and batch, and the gradients are compared.

Protocol: ``--warmup`` steps of each, then ``--rounds`` rounds of a block of ``--block`` + 1
minidl steps, a pause, the same block in PyTorch's process, a pause; the first step of each
block is not counted, and figures are medians. The per-layer table repeats the protocol with
minidl's steps timed layer by layer and, in PyTorch's process, the aten calls its autograd
makes for each layer. (``minidl bench smallcnn --compare-torch`` compares whole training steps
through the engine, with ``minidl.tools.bench.TorchProcess``.)

The first minidl kernel call puts NumPy's BLAS on one thread (see
``minidl.kernels.parallel``), so the NumPy Linear here runs single-threaded, as it would in
the engine. The machine must be otherwise idle: a busy core stalls every parallel launch of
both libraries for milliseconds.

    python benchmarks/speed/conv_bench.py [--rounds 20] [--block 5] [--batch-size 64] [--threads N]
    python benchmarks/speed/conv_bench.py --relu-kernel  # ReLU by minidl.kernels.pointwise.relu
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable

import numpy as np
from separate_processes import require_torch_absent

from minidl.tools.child_process import ChildProcess, alternate


def build_minidl(batch: int, rng: np.random.Generator):
    from minidl.layers.activation.relu import ReLU
    from minidl.layers.base import Context
    from minidl.layers.convolution.conv2d import Conv2d
    from minidl.layers.pooling.pool import MaxPool2d

    layers = [("conv1", Conv2d(1, 32, 3, padding=1)), ("relu1", ReLU()),
              ("pool1", MaxPool2d(2)), ("conv2", Conv2d(32, 64, 3, padding=1)),
              ("relu2", ReLU()), ("pool2", MaxPool2d(2))]
    shape = (batch, 1, 28, 28)
    dt = np.dtype(np.float32)
    net = []
    for name, layer in layers:
        layer.name = name
        out_shape = layer.output_shapes([shape])[0]
        params = {k: s.initial_value(rng, dt) for k, s in layer.param_specs().items()}
        ws = max(layer.forward_workspace_bytes([shape], dt),
                 layer.backward_workspace_bytes([shape], dt))
        net.append({
            "name": name, "layer": layer, "in_shape": shape, "out": np.empty(out_shape, dt),
            "grad_in": np.empty(shape, dt), "params": params,
            "grads": {k: np.empty_like(v) for k, v in params.items()},
            "stash": {k: np.empty(s, d) for k, (s, d) in layer.stash_specs([shape], dt).items()},
            "ws": np.empty(ws, np.uint8) if ws else None,
        })
        shape = out_shape
    fan_in = int(np.prod(shape[1:]))
    lin_w = rng.uniform(-1, 1, (10, fan_in)).astype(dt) / np.float32(np.sqrt(fan_in))
    lin_b = np.zeros(10, dt)
    return net, Context(), {"weight": lin_w, "bias": lin_b}


def minidl_step_fn(net, ctx, lin, x: np.ndarray, y: np.ndarray,
                   timer: dict[str, list[float]] | None = None) -> Callable[[], float]:
    n = x.shape[0]
    flat_dim = lin["weight"].shape[1]
    logits = np.empty((n, 10), np.float32)
    dlogits = np.empty_like(logits)
    dflat = np.empty((n, flat_dim), np.float32)
    lin["grad_weight"] = np.empty_like(lin["weight"])
    lin["grad_bias"] = np.empty_like(lin["bias"])
    onehot = np.zeros((n, 10), np.float32)
    onehot[np.arange(n), y] = 1

    def tick(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        if timer is not None:
            timer.setdefault(name, []).append(t1 - t0)
        return t1

    def step() -> float:
        t = time.perf_counter()
        h = x
        for e in net:
            e["layer"].forward(ctx, [h], [e["out"]], e["params"], e["stash"], e["ws"])
            h = e["out"]
            t = tick(e["name"] + ".fwd", t)
        flat = h.reshape(n, flat_dim)
        np.matmul(flat, lin["weight"].T, out=logits)
        np.add(logits, lin["bias"], out=logits)
        m = logits.max(axis=1, keepdims=True)
        np.subtract(logits, m, out=dlogits)
        np.exp(dlogits, out=dlogits)
        s = dlogits.sum(axis=1, keepdims=True)
        loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - logits[np.arange(n), y]))
        np.divide(dlogits, s, out=dlogits)
        np.subtract(dlogits, onehot, out=dlogits)
        np.multiply(dlogits, np.float32(1.0 / n), out=dlogits)
        np.matmul(dlogits.T, flat, out=lin["grad_weight"])
        dlogits.sum(axis=0, out=lin["grad_bias"])
        np.matmul(dlogits, lin["weight"], out=dflat)
        t = tick("linear+loss", t)
        g = dflat.reshape(h.shape)
        for i in range(len(net) - 1, -1, -1):
            e = net[i]
            keep = e["layer"]
            inputs = [x if i == 0 else net[i - 1]["out"]] if keep.retain_inputs else [None]
            outputs = [e["out"]] if keep.retain_outputs else [None]
            gin = None if i == 0 else e["grad_in"]
            keep.backward(ctx, [g], [gin], inputs, outputs, e["params"], e["grads"],
                          e["stash"], e["ws"])
            g = gin
            t = tick(e["name"] + ".bwd", t)
        return loss

    return step


def minidl_weights(net, lin) -> dict[str, np.ndarray]:
    """The trainable weights, named as in :func:`minidl_grads`."""
    return {"conv1.weight": net[0]["params"]["weight"], "conv1.bias": net[0]["params"]["bias"],
            "conv2.weight": net[3]["params"]["weight"], "conv2.bias": net[3]["params"]["bias"],
            "linear.weight": lin["weight"], "linear.bias": lin["bias"]}


def minidl_grads(net, lin) -> dict[str, np.ndarray]:
    """The gradients of the last step, named as in :func:`minidl_weights`."""
    return {"conv1.weight": net[0]["grads"]["weight"], "conv1.bias": net[0]["grads"]["bias"],
            "conv2.weight": net[3]["grads"]["weight"], "conv2.bias": net[3]["grads"]["bias"],
            "linear.weight": lin["grad_weight"], "linear.bias": lin["grad_bias"]}


#: (index in the torch Sequential, name prefix in the weight dicts)
TORCH_PARAM_LAYERS = ((0, "conv1"), (3, "conv2"), (7, "linear"))


def torch_net(weights: dict[str, np.ndarray]):
    import torch

    fan_in = weights["linear.weight"].shape[1]
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(fan_in, 10))
    with torch.no_grad():
        for idx, name in TORCH_PARAM_LAYERS:
            model[idx].weight.copy_(torch.from_numpy(weights[f"{name}.weight"]))
            model[idx].bias.copy_(torch.from_numpy(weights[f"{name}.bias"]))
    return model
def torch_step_fn(model, x: np.ndarray, y: np.ndarray) -> Callable[[], float]:
    import torch

    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        model.zero_grad(set_to_none=False)
        loss = loss_fn(model(xt), yt)
        loss.backward()
        return float(loss.detach())

    return step


def torch_layer_fns(model, x: np.ndarray) -> dict[str, Callable[[], object]]:
    """The aten calls of one torch training step, one per layer and direction."""
    import torch

    aten = torch.ops.aten
    c1, c2 = model[0], model[3]
    with torch.no_grad():
        a0 = torch.from_numpy(x)
        a1 = torch.nn.functional.conv2d(a0, c1.weight, c1.bias, padding=1)
        a2 = torch.relu(a1)
        a3, i3 = aten.max_pool2d_with_indices(a2, [2, 2], [2, 2])
        a4 = torch.nn.functional.conv2d(a3, c2.weight, c2.bias, padding=1)
        a5 = torch.relu(a4)
        a6, i6 = aten.max_pool2d_with_indices(a5, [2, 2], [2, 2])
        g6, g4, g1 = torch.randn_like(a6), torch.randn_like(a4), torch.randn_like(a1)

    def conv_b(g, a, c, mask):
        return lambda: aten.convolution_backward(g, a, c.weight, [c.out_channels], [1, 1],
                                                 [1, 1], [1, 1], False, [0, 0], 1, mask)

    fns = {
        "conv1.fwd": lambda: torch.nn.functional.conv2d(a0, c1.weight, c1.bias, padding=1),
        "relu1.fwd": lambda: torch.relu(a1),
        "pool1.fwd": lambda: aten.max_pool2d_with_indices(a2, [2, 2], [2, 2]),
        "conv2.fwd": lambda: torch.nn.functional.conv2d(a3, c2.weight, c2.bias, padding=1),
        "relu2.fwd": lambda: torch.relu(a4),
        "pool2.fwd": lambda: aten.max_pool2d_with_indices(a5, [2, 2], [2, 2]),
        "pool2.bwd": lambda: aten.max_pool2d_with_indices_backward(
            g6, a5, [2, 2], [2, 2], [0, 0], [1, 1], False, i6),
        "relu2.bwd": lambda: aten.threshold_backward(g4, a5, 0),
        "conv2.bwd": conv_b(g4, a3, c2, [True, True, True]),
        "pool1.bwd": lambda: aten.max_pool2d_with_indices_backward(
            a3, a2, [2, 2], [2, 2], [0, 0], [1, 1], False, i3),
        "relu1.bwd": lambda: aten.threshold_backward(g1, a2, 0),
        "conv1.bwd": conv_b(g1, a0, c1, [False, True, True]),
    }
    with torch.no_grad():
        return {k: (lambda f=f: _no_grad(f)) for k, f in fns.items()}


def _no_grad(f):
    import torch

    with torch.no_grad():
        return f()


class TorchSmallCNN:
    """The PyTorch side, built and timed in a :class:`ChildProcess` of its own."""

    def __init__(self, weights: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> None:
        self.model = torch_net(weights)
        self.step = torch_step_fn(self.model, x, y)
        self.layer_fns = torch_layer_fns(self.model, x)

    def describe(self) -> str:
        import torch

        return f"torch {torch.__version__}, {torch.get_num_threads()} threads"

    def gradients(self) -> dict[str, np.ndarray]:
        """One step's gradients, named as in :func:`minidl_grads`."""
        self.step()
        return {f"{name}.{p}": getattr(self.model[idx], p).grad.numpy().copy()
                for idx, name in TORCH_PARAM_LAYERS for p in ("weight", "bias")}

    def time_steps(self, count: int) -> list[float]:
        """Seconds of each of ``count`` forward + backward steps."""
        return _timed(self.step, count)

    def time_layers(self, count: int) -> dict[str, list[float]]:
        """Seconds of each layer's aten calls, over ``count`` passes of all of them."""
        times: dict[str, list[float]] = {k: [] for k in self.layer_fns}
        for _ in range(count):
            for k, f in self.layer_fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        return times


def _timed(fn: Callable[[], object], count: int) -> list[float]:
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def max_relative_difference(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    return max(float(np.abs(ours[k] - v).max() / (np.abs(v).max() + 1e-30))
               for k, v in theirs.items())


def _use_relu_kernel() -> None:
    """Patch ReLU's forward/backward to the one-pass threaded kernels (what
    layers/activation/relu.py would do once it adopts them)."""
    from minidl.kernels.pointwise.relu import relu_backward, relu_forward
    from minidl.layers.activation.relu import ReLU

    def forward(self, ctx, inputs, outputs, params, stash, workspace):
        relu_forward(inputs[0], outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        if grad_inputs[0] is not None:
            relu_backward(grad_outputs[0], outputs[0], grad_inputs[0])

    ReLU.forward, ReLU.backward = forward, backward


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="blocks per framework")
    ap.add_argument("--block", type=int, default=5,
                    help="counted steps per block (one more runs first, not counted)")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each before timing")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="MINIDL_NUM_THREADS")
    ap.add_argument("--no-layers", action="store_true", help="skip the per-layer table")
    ap.add_argument("--no-torch", action="store_true", help="time minidl alone")
    ap.add_argument("--relu-kernel", action="store_true",
                    help="run ReLU through minidl.kernels.pointwise.relu instead of "
                         "layers/activation/relu.py's NumPy")
    args = ap.parse_args(argv)
    for name in ("rounds", "block", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    return args


def start_torch(args: argparse.Namespace, weights: dict[str, np.ndarray], x: np.ndarray,
                y: np.ndarray) -> ChildProcess | None:
    """PyTorch's side in its own process, or None (--no-torch, or torch not installed)."""
    if args.no_torch:
        return None
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: minidl alone")
        return None
    return ChildProcess(TorchSmallCNN, weights, x, y)


def time_steps(args: argparse.Namespace, net, lin, step_m: Callable[[], float],
               torch_side: ChildProcess | None) -> None:
    """The gradients compared, then whole steps of both sides alternated: their medians."""
    if torch_side is not None:
        step_m()
        err = max_relative_difference(minidl_grads(net, lin), torch_side.call("gradients"))
        print(f"{torch_side.call('describe')} (in a process of its own); "
              f"max relative gradient difference {err:.2e}")
    require_torch_absent()
    for _ in range(args.warmup):
        step_m()
    if torch_side is not None:
        torch_side.call("time_steps", args.warmup)
    times = alternate(args.rounds, args.block, lambda k: _timed(step_m, k), torch_side,
                      "time_steps", before_round=require_torch_absent)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"step (batch {args.batch_size}, median of {args.rounds} x {args.block} steps "
          "in alternating blocks):")
    for k, v in med.items():
        q1, q3 = np.percentile(times[k], [25, 75]) * 1e3
        print(f"  {k:7s} {v:7.2f} ms   (IQR {q1:.2f}-{q3:.2f})")
    if "torch" in med:
        print(f"  ratio minidl/torch: {med['minidl'] / med['torch']:.2f}x")


def time_layers(args: argparse.Namespace, net, ctx, lin, x: np.ndarray, y: np.ndarray,
                torch_side: ChildProcess | None) -> dict[str, dict[str, list[float]]]:
    """Seconds of each layer's forward and backward on both sides, alternated."""
    step_parts: dict[str, list[float]] = {}
    step_timed = minidl_step_fn(net, ctx, lin, x, y, timer=step_parts)

    def minidl_layers(count: int) -> dict[str, list[float]]:
        step_parts.clear()
        for _ in range(count):
            step_timed()
        return dict(step_parts)

    for _ in range(args.warmup):
        step_timed()
    return alternate(args.rounds, args.block, minidl_layers, torch_side, "time_layers",
                     before_round=require_torch_absent)


def print_layers(layer_times: dict[str, dict[str, list[float]]]) -> None:
    lt, tt = layer_times["minidl"], layer_times.get("torch", {})
    print("per layer (median ms):      minidl    torch")
    tot_m = tot_t = 0.0
    for k, v in lt.items():
        m = float(np.median(v)) * 1e3
        tv = float(np.median(tt[k])) * 1e3 if k in tt else float("nan")
        tot_m += m
        tot_t += 0 if np.isnan(tv) else tv
        print(f"  {k:22s} {m:8.2f} {tv:8.2f}")
    print(f"  {'sum':22s} {tot_m:8.2f} {tot_t:8.2f}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        os.environ["MINIDL_NUM_THREADS"] = str(args.threads)
    if args.relu_kernel:
        _use_relu_kernel()

    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)
    net, ctx, lin = build_minidl(args.batch_size, rng)
    step_m = minidl_step_fn(net, ctx, lin, x, y)
    torch_side = start_torch(args, minidl_weights(net, lin), x, y)
    try:
        time_steps(args, net, lin, step_m, torch_side)
        if args.no_layers:
            return
        layer_times = time_layers(args, net, ctx, lin, x, y, torch_side)
        require_torch_absent()
    finally:
        if torch_side is not None:
            torch_side.close()
    print_layers(layer_times)


if __name__ == "__main__":
    main()
