"""``minidl bench``: median step time and peak memory per memory spec, optionally beside PyTorch.

Configurations alternate in short blocks of steps (``block`` steps of each per round, the first
step of each block not counted) so that the machine's noise hits them alike. Figures are
medians over the counted steps.

PyTorch runs in a process of its own (:func:`torch_worker`), driven block by block over a
pipe and idle while minidl runs, and the other way round: in one process, each runtime's
thread pools slow the other (OpenBLAS, OpenMP and Numba threads spin for a while after their
work; timed right after minidl in the same process, PyTorch took 3.5x its own time on
smallcnn). A short pause separates the two frameworks' blocks.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..analysis.dryrun import auto_device_memory
from ..interop.torch_bridge import to_torch
from ..net.labels import default_label_shape
from ..net.optim import SGD
from ..train.trainer import Trainer

#: Seconds between one framework's block of steps and the other's (spinning threads settle).
SWITCH_PAUSE_S = 0.2


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
) -> dict[str, Any]:
    """Train ``steps`` counted steps (+ ``warmup``) per spec on one synthetic batch, the
    configurations alternating in blocks of ``block`` steps (+1 uncounted). ``emulate_link``
    (a target name or profile): each Trainer emulates its host link (``Trainer(emulate_link=)``).
    ``device``: where minidl's trainers run (``"cuda"``: each step is timed until the GPU has
    finished it, and PyTorch, with ``compare_torch``, runs on the same GPU).
    """
    from tqdm.auto import tqdm

    kind = "cpu" if device == "cpu" else "cuda"
    torch = None  # started first: an unusable model factory fails before any minidl work
    if compare_torch:
        if importlib.util.find_spec("torch") is None:
            print("torch is not installed: --compare-torch skipped")
        else:
            torch = TorchProcess(make_net, shape, batch_size, seed, lr,  # (cuda-strict: cpu)
                                 device=device if device.startswith("cuda") and
                                 device != "cuda-strict" else "cpu")
    runners: list[tuple[str, Callable[[], float]]] = []
    times: dict[str, list[float]] = {"torch": []}
    trainers = []
    try:
        for spec in specs:
            net = make_net()
            cap = auto_device_memory(net, batch_size, spec, "sgd", shape, device_kind=kind,
                                     emulate_link=emulate_link)
            tr = Trainer(net, SGD(net.parameters(), lr=lr, momentum=0.9), memory=spec,
                         device=device, device_memory=cap, seed=seed, emulate_link=emulate_link)
            trainers.append(tr)
        x, y = synthetic_batch(trainers[0].net, shape, batch_size, seed)
        for spec, tr in zip(specs, trainers):
            runners.append((spec.spec, functools.partial(_timed_step, tr, x, y)))
            times[spec.spec] = []
        for _, fn in runners:
            for _ in range(warmup):
                fn()
        if torch is not None:
            torch.run(warmup)
        rounds = max(1, -(-steps // block))
        for _ in tqdm(range(rounds), disable=not progress, desc="bench", unit="round"):
            for name, fn in runners:
                for k in range(block + 1):
                    t0 = time.perf_counter()
                    fn()
                    if k > 0:
                        times[name].append(time.perf_counter() - t0)
            if torch is not None:
                time.sleep(SWITCH_PAUSE_S)
                times["torch"] += torch.run(block + 1)[1:]
                time.sleep(SWITCH_PAUSE_S)
    finally:
        if torch is not None:
            torch.close()
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
        for key in ("swap", "recompute", "compression", "split", "bptt", "link_emulation"):
            if key in rep:
                row[key] = rep[key]
        results.append(row)
    out: dict[str, Any] = {"batch_size": batch_size, "input": list(shape), "steps": steps,
                           "results": results}
    if torch is not None:
        med = float(np.median(times["torch"]))
        out["torch"] = {"step_time_median_s": med, "time_ratio": results[0]["step_time_median_s"]
                        / med, "process": "separate", "device": torch.device}
    return out


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


class TorchProcess:
    """The same network in PyTorch (:func:`~minidl.interop.torch_bridge.to_torch`, same weights,
    same
    batch), stepped in a child process of its own: ``run(k)`` times ``k`` steps there."""

    def __init__(self, make_net: Callable[[], Any], shape: tuple[int, ...], batch_size: int,
                 seed: int, lr: float, device: str = "cpu") -> None:
        #: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:N"``: cuDNN on, TF32 off).
        self.device = device
        try:
            payload = pickle.dumps((make_net, tuple(shape), batch_size, seed, lr, device))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError("compare_torch needs a picklable make_net (a module-level function "
                             f"or functools.partial), not {make_net!r}: {e}") from None
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            f.write(payload)
            self._payload = f.name
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from minidl.tools.bench import torch_worker; torch_worker()",
             self._payload], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # "ready": the model is built

    def _read(self) -> Any:
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch process stopped (exit code {self._proc.wait()})")
        return json.loads(line)

    def run(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` training steps, run in the child process."""
        self._proc.stdin.write(f"{steps}\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        os.unlink(self._payload)


def torch_worker() -> None:
    """Child side of :class:`TorchProcess`: build the model from the pickled arguments in
    ``sys.argv[1]``, then for each line ``k`` on stdin time ``k`` steps and print the list."""
    with open(sys.argv[1], "rb") as f:
        make_net, shape, batch_size, seed, lr, device = pickle.load(f)
    net = make_net()
    x, y = synthetic_batch(net, shape, batch_size, seed)
    step = _torch_runner(net, x, y, lr, device)
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        print(json.dumps(times), flush=True)


def _torch_runner(net: Any, x: np.ndarray, y: np.ndarray, lr: float,
                  device: str = "cpu") -> Callable[[], float]:
    """PyTorch's training step of ``net``'s twin (same weights) on ``device``; on a GPU in
    FP32 as minidl (TF32 off), the batch sent from pinned memory every step as minidl's, the
    step timed until the GPU has finished it."""
    import torch

    model = to_torch(net)
    model.train()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    sync: Callable[[], None] = lambda: None  # noqa: E731
    if device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        model = model.to(device)
        xt, yt = xt.pin_memory(), yt.pin_memory()
        sync = torch.cuda.synchronize
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> float:
        xd, yd = xt.to(device, non_blocking=True), yt.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=False)
        out = model(xd)
        loss = loss_fn(out.reshape(-1, out.shape[-1]), yd.reshape(-1))
        loss.backward()
        opt.step()
        sync()
        return loss.item()

    return step
