"""``minidl bench``: median step time and peak memory per memory spec, optionally beside PyTorch.

Configurations alternate in short blocks of steps (``block`` steps of each per round, the first
step of each block not counted) so that the machine's noise hits them alike. Figures are
medians over the counted steps.

PyTorch runs in a process of its own (:class:`TorchProcess`, a
:class:`~minidl.tools.child_process.ChildProcess`), driven block by block over a pipe and idle
while minidl runs, and the other way round (:func:`~minidl.tools.child_process.alternate`): in
one process, each runtime's thread pools slow the other (OpenBLAS, OpenMP and Numba threads
spin for a while after their work; timed right after minidl in the same process, PyTorch took
3.5x its own time on smallcnn). A short pause separates the two frameworks' blocks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..analysis.dryrun import auto_device_memory
from ..interop.torch_bridge import to_torch
from ..memory.ir.names import DeviceKind
from ..memory.ir.precision import Precision
from ..net.labels import default_label_shape
from ..net.optim import SGD
from ..train.trainer import Trainer
from .child_process import SWITCH_PAUSE_S, ChildProcess, alternate

__all__ = ["SWITCH_PAUSE_S", "TorchProcess", "TorchSteps", "run_bench", "synthetic_batch"]


def synthetic_batch(net: Any, shape: tuple[int, ...], batch_size: int, seed: int):
    """One seeded batch for ``net``: Gaussian images (or random tokens for integer inputs)
    and random labels shaped like the output without its class axis."""
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
    emulate_link: Any = None,
    device: str = "cpu",
    precision: str = "fp32",
) -> dict[str, Any]:
    """Train ``steps`` counted steps (+ ``warmup``) per spec on one synthetic batch, the
    configurations alternating in blocks of ``block`` steps (+1 uncounted). ``emulate_link``
    (a target name or profile): each Trainer emulates its host link (``Trainer(emulate_link=)``).
    ``device``: where minidl's trainers run (``"cuda"``: each step is timed until the GPU has
    finished it, and PyTorch, with ``compare_torch``, runs on the same GPU). ``precision``:
    what every trainer computes in (:mod:`~minidl.memory.ir.precision`), and PyTorch under
    ``torch.autocast`` in the matching half dtype.
    """
    from tqdm.auto import tqdm

    # started first: an unusable model factory fails before any minidl work
    torch = _torch_process(make_net, shape, batch_size, seed, lr, device, precision) \
        if compare_torch else None
    try:
        trainers = [_trainer(make_net, shape, batch_size, spec, lr, seed, emulate_link, device,
                             precision) for spec in specs]
        x, y = synthetic_batch(trainers[0].net, shape, batch_size, seed)
        runners = [functools.partial(_timed_step, tr, x, y) for tr in trainers]
        for fn in runners:
            for _ in range(warmup):
                fn()
        if torch is not None:
            torch.run(warmup)
        rounds = tqdm(range(max(1, -(-steps // block))), disable=not progress, desc="bench",
                      unit="round")
        times = alternate(rounds, block, functools.partial(_time_runners, runners), torch,
                          "run")
    finally:
        if torch is not None:
            torch.close()
    results = _results(specs, trainers, times["minidl"])
    out: dict[str, Any] = {"batch_size": batch_size, "input": list(shape), "steps": steps,
                           "precision": str(precision), "results": results}
    if torch is not None:
        med = float(np.median(times.get("torch", [])))
        out["torch"] = {"step_time_median_s": med, "time_ratio": results[0]["step_time_median_s"]
                        / med, "process": "separate", "device": torch.device}
    return out


def _torch_process(make_net: Callable[[], Any], shape: tuple[int, ...], batch_size: int,
                   seed: int, lr: float, device: str, precision: str = "fp32"
                   ) -> TorchProcess | None:
    """PyTorch's side of ``compare_torch`` on ``device``'s GPU (else the CPU), or ``None``
    (said) when torch is not installed."""
    if importlib.util.find_spec("torch") is None:
        print("torch is not installed: --compare-torch skipped")
        return None
    on_gpu = device.startswith("cuda") and device != "cuda-strict"  # (cuda-strict: cpu)
    return TorchProcess(make_net, shape, batch_size, seed, lr, device=device if on_gpu else "cpu",
                        precision=str(precision))


def _trainer(make_net: Callable[[], Any], shape: tuple[int, ...], batch_size: int, spec: Any,
             lr: float, seed: int, emulate_link: Any, device: str,
             precision: str = "fp32") -> Trainer:
    """A new ``make_net()`` in a Trainer under ``spec`` (SGD with momentum) computing in
    ``precision``, its device memory what a dry run says it needs."""
    net = make_net()
    kind = DeviceKind.CPU if device == DeviceKind.CPU else DeviceKind.CUDA
    cap = auto_device_memory(net, batch_size, spec, "sgd", shape, device_kind=kind,
                             emulate_link=emulate_link, precision=precision)
    return Trainer(net, SGD(net.parameters(), lr=lr, momentum=0.9), memory=spec,
                   device=device, device_memory=cap, seed=seed, emulate_link=emulate_link,
                   precision=precision)


def _time_runners(runners: list[Callable[[], None]], count: int) -> dict[int, list[float]]:
    """``count`` timed steps of each runner in turn, by the runner's index."""
    times: dict[int, list[float]] = {}
    for i, fn in enumerate(runners):
        own = times[i] = []
        for _ in range(count):
            t0 = time.perf_counter()
            fn()
            own.append(time.perf_counter() - t0)
    return times


def _results(specs: list[Any], trainers: list[Trainer],
             times: dict[int, list[float]]) -> list[dict[str, Any]]:
    """Each spec's row: its peaks, median step and ratio to the first spec's, and what its
    memory report says of swaps, recomputation, compression, splits, BPTT and the link (the
    steps of specs spelled alike pooled, as one spec)."""
    pooled: dict[str, list[float]] = {}
    for i, spec in enumerate(specs):
        pooled.setdefault(spec.spec, []).extend(times.get(i, []))
    results = []
    base = None
    for spec, tr in zip(specs, trainers):
        med = float(np.median(pooled[spec.spec]))
        base = base or med
        rep = tr.memory_report()
        row = {
            "spec": spec.spec,
            "peak_allocated_bytes": rep["peak_allocated_bytes"],
            "peak_reserved_bytes": rep["peak_reserved_bytes"],
            "step_time_median_s": med,
            "time_ratio": med / base,
        }
        for key in ("swap", "recompute", "compression", "split", "bptt", "link_emulation"):
            if key in rep:
                row[key] = rep[key]
        results.append(row)
    return results


def _timed_step(tr: Trainer, x: np.ndarray, y: np.ndarray) -> None:
    """One step, returning when the device has finished it (a GPU: the host does not wait
    inside the step; it waits once at its end)."""
    tr.step(x, y, wait=False)
    sync = getattr(tr.device, "synchronize", None)
    if sync is not None and tr.asynchronous:
        sync()


def _num_classes(net: Any, shape: tuple[int, ...], batch_size: int) -> int:
    unrolled = net.for_shapes([(batch_size, *shape)])
    shapes, _ = unrolled.infer([(batch_size, *shape)])
    return int(shapes[unrolled.output_values[0]][-1])


class TorchProcess(ChildProcess):
    """The same network in PyTorch (:func:`~minidl.interop.torch_bridge.to_torch`, same
    weights, same batch), stepped in a child process of its own (:class:`TorchSteps` there):
    ``run(k)`` times ``k`` steps there."""

    def __init__(self, make_net: Callable[[], Any], shape: tuple[int, ...], batch_size: int,
                 seed: int, lr: float, device: str = "cpu", precision: str = "fp32") -> None:
        #: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:N"``: cuDNN on, TF32 off).
        self.device = device
        try:
            pickle.dumps(make_net)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError("compare_torch needs a picklable make_net (a module-level function "
                             f"or functools.partial), not {make_net!r}: {e}") from None
        super().__init__(TorchSteps, make_net, tuple(shape), batch_size, seed, lr, device,
                         precision, name="PyTorch process")

    def run(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` training steps, run in the child process."""
        return self.call("run", steps)


class TorchSteps:
    """Child side of :class:`TorchProcess`: PyTorch's twin of ``make_net()`` and its training
    step on one synthetic batch (:func:`synthetic_batch` with ``seed``)."""

    def __init__(self, make_net: Callable[[], Any], shape: tuple[int, ...], batch_size: int,
                 seed: int, lr: float, device: str = "cpu", precision: str = "fp32") -> None:
        net = make_net()
        x, y = synthetic_batch(net, shape, batch_size, seed)
        self._step = _torch_runner(net, x, y, lr, device, precision)

    def run(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` training steps."""
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self._step()
            times.append(time.perf_counter() - t0)
        return times


def _torch_runner(net: Any, x: np.ndarray, y: np.ndarray, lr: float,
                  device: str = "cpu", precision: str = "fp32") -> Callable[[], float]:
    """PyTorch's training step of ``net``'s twin (same weights) on ``device``; on a GPU in
    FP32 as minidl (TF32 off), the batch sent from pinned memory every step as minidl's, the
    step timed until the GPU has finished it. A mixed ``precision``: forward and loss under
    ``torch.autocast`` in its half dtype (fp16 with a ``GradScaler``), float32 weights."""
    import torch

    model = to_torch(net)
    model.train()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if device != DeviceKind.CPU:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        model = model.to(device)
        xt, yt = xt.pin_memory(), yt.pin_memory()
        sync = torch.cuda.synchronize
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    half = Precision.of(precision).half_dtype  # (torch's dtype of that name; None: fp32)
    kind = "cpu" if device == DeviceKind.CPU else "cuda"

    def autocast() -> Any:
        return torch.autocast(kind, dtype=getattr(torch, half)) if half \
            else contextlib.nullcontext()

    scaler = torch.amp.GradScaler(kind) if half == "float16" else None

    def step() -> float:
        xd, yd = xt.to(device, non_blocking=True), yt.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        with autocast():
            out = model(xd)
            loss = loss_fn(out.reshape(-1, out.shape[-1]), yd.reshape(-1))
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sync()
        return loss.item()

    return step
