"""``minidl bench``: median step time and peak memory per memory spec, optionally beside PyTorch.

Configurations alternate in short blocks of steps (``block`` steps of each per round, the first
step of each block not counted) so that the machine's noise hits them alike while no
configuration is timed right after another one's thread pools (OpenBLAS and Numba threads
spin for a while after their work: stepping torch right after minidl doubled torch's time
here). Figures are medians over the counted steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def synthetic_batch(net: Any, shape: tuple[int, ...], batch_size: int, seed: int):
    """One seeded batch for ``net``: Gaussian images (or random tokens for integer inputs)
    and random labels shaped like the output without its class axis."""
    from .dryrun import default_label_shape

    rng = np.random.default_rng(seed)
    batch = (batch_size, *shape)
    num_classes = _num_classes(net, shape, batch_size)
    if np.issubdtype(net.inputs[0].dtype, np.integer):
        vocab = getattr(net, "vocab_size", None) or num_classes
        x = rng.integers(0, vocab, size=batch).astype(np.int64)
    else:
        x = rng.standard_normal(batch).astype(np.float32)
    y = rng.integers(0, num_classes, size=default_label_shape(net, batch)).astype(np.int64)
    return x, y


def run_bench(
    make_net: Callable[[], Any],
    shape: tuple[int, ...],
    batch_size: int,
    specs: list[Any],
    steps: int = 20,
    warmup: int = 3,
    compare_torch: bool = False,
    seed: int = 0,
    progress: bool = True,
    lr: float = 0.01,
    block: int = 5,
) -> dict[str, Any]:
    """Train ``steps`` counted steps (+ ``warmup``) per spec on one synthetic batch, the
    configurations alternating in blocks of ``block`` steps (+1 uncounted)."""
    from tqdm.auto import tqdm

    from .dryrun import auto_device_memory
    from .optim import SGD
    from .trainer import Trainer

    runners: list[tuple[str, Callable[[], float]]] = []
    trainers = []
    for spec in specs:
        net = make_net()
        cap = auto_device_memory(net, batch_size, spec, "sgd", shape)
        tr = Trainer(net, SGD(net.parameters(), lr=lr, momentum=0.9), memory=spec,
                     device_memory=cap, seed=seed)
        trainers.append(tr)
    x, y = synthetic_batch(trainers[0].net, shape, batch_size, seed)
    for spec, tr in zip(specs, trainers):
        runners.append((spec.spec, lambda tr=tr: tr.step(x, y)))
    torch_ok = False
    if compare_torch:
        try:
            import torch  # noqa: F401

            torch_ok = True
        except ImportError:
            print("torch is not installed: --compare-torch skipped")
    if torch_ok:
        runners.append(("torch", _torch_runner(make_net(), x, y, lr)))
    times: dict[str, list[float]] = {name: [] for name, _ in runners}
    for _, fn in runners:
        for _ in range(warmup):
            fn()
    rounds = max(1, -(-steps // block))
    for _ in tqdm(range(rounds), disable=not progress, desc="bench", unit="round"):
        for name, fn in runners:
            for k in range(block + 1):
                t0 = time.perf_counter()
                fn()
                if k > 0:
                    times[name].append(time.perf_counter() - t0)
    results = []
    base = None
    for spec, tr in zip(specs, trainers):
        med = float(np.median(times[spec.spec]))
        base = base or med
        rep = tr.memory_report()
        row = {
            "spec": spec.spec,
            "peak_allocated_bytes": rep["peak_allocated_bytes"],
            "peak_reserved_bytes": rep["peak_reserved_bytes"],
            "step_time_median_s": med,
            "time_ratio": med / base,
        }
        for key in ("swap", "recompute", "compression", "split", "bptt"):
            if key in rep:
                row[key] = rep[key]
        results.append(row)
    out: dict[str, Any] = {"batch_size": batch_size, "input": list(shape), "steps": steps,
                           "results": results}
    if torch_ok:
        med = float(np.median(times["torch"]))
        out["torch"] = {"step_time_median_s": med, "time_ratio": results[0]["step_time_median_s"]
                        / med}
    return out


def _num_classes(net: Any, shape: tuple[int, ...], batch_size: int) -> int:
    unrolled = net.for_shapes([(batch_size, *shape)])
    shapes, _ = unrolled.infer([(batch_size, *shape)])
    return int(shapes[unrolled.output_values[0]][-1])


def _torch_runner(net: Any, x: np.ndarray, y: np.ndarray, lr: float) -> Callable[[], float]:
    import torch

    from .torch_bridge import to_torch

    model = to_torch(net)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=False)
        out = model(xt)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), yt.reshape(-1))
        loss.backward()
        opt.step()
        return float(loss)

    return step
