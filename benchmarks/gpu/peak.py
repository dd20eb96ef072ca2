"""Dry-run peak against the GPU's measured peak, per model and memory spec (JSON list in
argv[1]). Step 1 measures CuPy's temporaries, the engine then reserves their scratch block;
after step 3 (peak statistics reset before it) the measured allocated peak must equal
``dry_run(..., device_kind="cuda", scratch_bytes=<that block>)``. Also: an evaluation at 4x the
batch (its temporaries overflow the block into the pool instead of halving the batch), the
bytes outside the arena, and CuPy's own pool (0: nothing escaped the arena)."""

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

QUICK_CASES = [("smallcnn", (1, 12, 12), 4, "vdnn"), ("resnet8", (3, 8, 8), 4, "reuse,inplace"),
               ("char-lstm", (8,), 2, "reuse,inplace")]
CASES = [("smallcnn", (1, 28, 28), 32, "reuse,inplace"), ("smallcnn", (1, 28, 28), 32, "vdnn"),
         ("smallcnn", (1, 28, 28), 32, "gist"), ("smallcnn", (1, 28, 28), 32, "reuse,dpr=fp16"),
         ("resnet20", (3, 32, 32), 16, "reuse,recompute=sqrt"),
         ("resnet20", (3, 32, 32), 16, "vdnn-all"), ("resnet20", (3, 32, 32), 16, "none"),
         ("char-lstm", (32,), 8, "reuse,inplace"), ("char-lstm", (32,), 8, "reuse,bptt=2")]


def _escaped(tr: minidl.Trainer) -> int:
    """Bytes CuPy's own pool ever held (emptied before the run): temporaries that escaped
    the arena (the strict device counts them itself)."""
    if DEVICE != "cuda":
        return tr.device.default_pool_peak
    import cupy as cp

    return int(cp.get_default_memory_pool().total_bytes())


def one(model: str, shape: tuple, batch: int, spec: str) -> dict:
    row: dict = {"model": model, "input": shape, "batch": batch, "spec": spec}
    make = lambda: get_model(model, input_shape=shape)  # noqa: E731
    net = make()
    x, y = synthetic_batch(net, shape, batch, 0)
    if DEVICE == "cuda":
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                        device=DEVICE, device_memory="256MiB" if QUICK else "2GiB")
    try:
        row["losses"] = [tr.step(x, y) for _ in range(2)]
        tr.pool.reset_peak_stats()
        row["losses"].append(tr.step(x, y))
        tr.device.synchronize()
        stats = tr.pool.stats()
        scratch = tr.engine.scratch.size if tr.engine.scratch is not None else 0
        row["scratch_bytes"] = scratch
        row["gpu_peak_allocated"] = stats["allocated_bytes.peak"]
        row["gpu_peak_reserved"] = stats["reserved_bytes.peak"]
        dry = minidl.dry_run(make(), batch, spec, input_shape=shape, device_kind="cuda",
                             scratch_bytes=scratch)
        row["dry_peak_allocated"] = dry["peak_allocated_bytes"]
        row["dry_equal"] = dry["peak_allocated_bytes"] == stats["allocated_bytes.peak"]
        rep = tr.memory_report()
        row["outside_arena"] = rep.get("outside_arena")
        row["device_temporaries"] = rep.get("device_temporaries")
        row["escaped_arena_bytes"] = _escaped(tr)
        if len(shape) == 3:
            xb = np.concatenate([x] * 4)
            tr.predict(xb, batch_size=len(xb))
            row["eval_4x_batch_halved"] = tr.observed.eval_splits
    finally:
        tr.close()
    return row


def main(out: str) -> None:
    rows = []
    for case in QUICK_CASES if QUICK else CASES:
        t0 = time.perf_counter()
        try:
            row = one(*case)
        except BaseException as e:  # noqa: BLE001 -- a finding
            row = {"model": case[0], "spec": case[3], "error": f"{type(e).__name__}: {e}"[:1500],
                   "traceback": traceback.format_exc()[-3000:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}, default=str),
              flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1])
