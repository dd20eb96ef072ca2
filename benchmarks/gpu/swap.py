"""Swapping on the GPU against the cost model's prediction for the card it runs on (JSON in
argv[1]; SWAP_TARGET, else the profile the GPU's name names, ``h200`` on an H200; ``h100``
where none does): vgg11 (SWAP_MODEL / SWAP_INPUT / SWAP_BATCH: default 3x64x64, batch 64) under
``reuse,inplace``, ``vdnn`` and ``vdnn-all``. Each spec's trainer steps in alternating rounds;
the measured step (host clock around a step that ends with the device), the device's iteration
time and stall (CUDA events), the copies and the link rate, against ``dry_run(target=...)``'s
predicted step, stall and overhead."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

import minidl
from minidl.net.optim import SGD
from minidl.tools.bench import synthetic_batch
from minidl.zoo.models import get_model

#: The device the check runs on (cuda; cuda-strict: the strict test device, on the CPU).
DEVICE = os.environ.get("GPUCHECK_DEVICE", "cuda")
QUICK = os.environ.get("GPUCHECK_QUICK") == "1"

SPECS = ["reuse,inplace", "vdnn", "vdnn-all"]


def target_for(device_name: str | None) -> str:
    """The cost model's profile of a GPU named ``device_name`` (CuPy's name: "NVIDIA H200",
    "NVIDIA A100-SXM4-80GB", ...): the profile with the most parts of its name among the name's
    words (``a100-80gb``: "a100" and "80gb"), else h100."""
    from minidl.memory.cost.targets import PROFILES

    words = set((device_name or "").lower().replace("-", " ").split())
    fits = [name for name in PROFILES if set(name.split("-")) <= words]
    return max(fits, key=lambda n: len(n.split("-")), default="h100")


def device_name() -> str | None:
    if DEVICE != "cuda":
        return None
    import cupy as cp

    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def main(out: str) -> None:
    model = os.environ.get("SWAP_MODEL", "smallcnn" if QUICK else "vgg11")
    shape = tuple(int(v) for v in os.environ.get(
        "SWAP_INPUT", "1x12x12" if QUICK else "3x64x64").split("x"))
    batch = int(os.environ.get("SWAP_BATCH", "4" if QUICK else "64"))
    target = os.environ.get("SWAP_TARGET") or target_for(device_name())
    res: dict = {"model": model, "input": shape, "batch": batch, "target": target, "specs": {}}

    def save() -> None:
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    trainers = {}
    x = y = None
    for spec in SPECS:
        r = res["specs"][spec] = {}
        try:
            pred = minidl.dry_run(get_model(model, input_shape=shape), batch, spec,
                                  input_shape=shape, target=target)["prediction"]
            r["predicted"] = {k: pred.get(k) for k in ("step_s", "oracle_s", "overhead",
                                                       "stall_s", "offloaded_bytes",
                                                       "prefetched_bytes")}
            net = get_model(model, input_shape=shape)
            if x is None:
                x, y = synthetic_batch(net, shape, batch, 0)
            tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                                device=DEVICE,
                                device_memory="256MiB" if QUICK else "8GiB")
            for _ in range(3):
                tr.step(x, y)
            tr.device.synchronize()
            trainers[spec] = tr
        except BaseException as e:  # noqa: BLE001 -- a finding
            r["error"] = f"{type(e).__name__}: {e}"[:1500]
            r["traceback"] = traceback.format_exc()[-3000:]
        save()
    measured = {s: {"step": [], "iteration": [], "stall": [], "copy": []} for s in trainers}
    for _ in range(3):
        for spec, tr in trainers.items():
            for _ in range(2):
                eng = tr.device.copy_engine
                eng.synchronize()
                b0, busy0 = eng.total_bytes, eng.busy_s
                t0 = time.perf_counter()
                tr.step(x, y, wait=False)
                tr.device.synchronize()
                m = measured[spec]
                m["step"].append(time.perf_counter() - t0)
                ex = tr.last_compiled.executor
                _ = ex.step_times  # (reads the events: the iteration's device time)
                m["iteration"].append(ex.iteration_s)
                m["stall"].append(tr.swap_stats.get("stall_s", 0.0))
                eng.synchronize()
                m["copy"].append((eng.total_bytes - b0, eng.busy_s - busy0))
    base = float(np.median(measured["reuse,inplace"]["step"])) \
        if "reuse,inplace" in measured else None
    for spec, m in measured.items():
        r = res["specs"][spec]
        r["measured_step_s"] = float(np.median(m["step"]))
        device_times = [v for v in m["iteration"] if v]  # (CUDA events: none on the CPU)
        r["measured_iteration_s"] = float(np.median(device_times)) if device_times else None
        r["measured_stall_s"] = float(np.median(m["stall"]))
        nbytes = float(np.median([c[0] for c in m["copy"]]))
        busy = float(np.median([c[1] for c in m["copy"]]))
        r["copy_bytes_per_step"], r["copy_busy_s_per_step"] = nbytes, busy
        r["link_GBps"] = nbytes / busy / 1e9 if busy > 0 else None
        if base:
            r["measured_overhead"] = r["measured_step_s"] / base - 1
        p = r.get("predicted") or {}
        if p.get("step_s"):
            r["measured_over_predicted_step"] = r["measured_step_s"] / p["step_s"]
        r["gpu_peak_allocated"] = trainers[spec].memory_report()["peak_allocated_bytes"]
    save()
    print(json.dumps({s: {k: v for k, v in r.items() if k != "traceback"}
                      for s, r in res["specs"].items()}, default=str, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
