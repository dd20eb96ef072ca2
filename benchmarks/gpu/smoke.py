"""Every kind of launch minidl makes, first and smallest, on the GPU; one JSON object per check
in argv[1] (rewritten after each, so a crash leaves what ran).

* every ``CUDA_LAUNCH_CASES`` case of tests/kernels (each CUDA kernel of minidl against its
  NumPy / CPU reference, on arrays the cases normally emulate): here on real CuPy arrays;
* the device: the arena, views, copies both ways, CuPy's temporaries routed into the arena,
  the bytes outside it;
* three training steps of smallcnn, resnet8 and char-lstm on the GPU against the CPU's, with
  no host synchronisation inside a step that does not wait, and CuPy's own pool empty.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

OUT = sys.argv[1]
REPO = Path(__file__).resolve().parents[2]
#: The device the check runs on (cuda; cuda-strict: the strict test device, on the CPU).
DEVICE = os.environ.get("GPUCHECK_DEVICE", "cuda")
results: dict = {"checks": {}, "device": DEVICE}


def check(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        r = {"ok": True, "value": fn()}
    except BaseException as e:  # noqa: BLE001 -- a finding, not a crash
        r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
             "traceback": traceback.format_exc()[-4000:]}
    r["seconds"] = round(time.perf_counter() - t0, 3)
    results["checks"][name] = r
    print(name, "ok" if r["ok"] else "FAILED " + r["error"][:300], f"({r['seconds']} s)",
          flush=True)
    with open(OUT, "w") as f:
        json.dump(results, f, indent=1, default=str)


def _transfers() -> tuple:
    """(to the device, back to the host) for the launch cases' arrays: CuPy's, or the strict
    test device's."""
    if DEVICE == "cuda":
        import cupy as cp

        return (lambda a: cp.asarray(np.array(a, copy=True)), cp.asnumpy,
                lambda: cp.cuda.Device().synchronize())
    from minidl.memory.testing.strict_device import StrictCudaDevice

    dev = StrictCudaDevice("16MiB")
    return (lambda a: dev.xp.asarray(np.array(a, copy=True)), lambda a: a.get(),
            dev.synchronize)


def launch_cases() -> None:
    """The emulated-launch cases, their device arrays made CuPy arrays (D: to the device, H:
    back to the host)."""
    to_device, to_host, sync = _transfers()
    folder = REPO / "tests" / "kernels"
    if str(folder) not in sys.path:  # (their shared emulated arrays, as tests/kernels/conftest.py)
        sys.path.insert(0, str(folder))
    for path in sorted(folder.glob("test_*.py")):
        if "\nCUDA_LAUNCH_CASES = " not in path.read_text():
            continue
        spec = importlib.util.spec_from_file_location(f"_gpucheck_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.D, mod.H = to_device, to_host
        cases = list(mod.CUDA_LAUNCH_CASES.items())
        if os.environ.get("GPUCHECK_QUICK") == "1":
            cases = cases[:1]  # (the check's own test: the plumbing, not every kernel)
        for name, case in cases:
            def run(case=case):
                with np.errstate(invalid="ignore"):
                    case(np.random.default_rng(0))
                sync()
                return "equal to the reference"
            check(f"launch:{path.stem}.{name}", run)


def device_basics() -> dict:
    if DEVICE != "cuda":
        return "cuda only"
    import cupy as cp

    from minidl.memory import CudaDevice, Pool
    from minidl.memory.devices.cuda_device import route_cupy_allocations

    with CudaDevice("64MiB", pinned_capacity="64MiB") as dev:
        pool = Pool(dev)
        x = pool.allocate(4 << 20).view((1 << 20,))
        x[...] = cp.arange(1 << 20, dtype=cp.float32)
        host = dev.host_empty((1 << 20,), np.float32)
        ev = dev.copy_engine.copy_async(host, x)
        ev.order_compute()
        y = pool.allocate(4 << 20).view((1 << 20,))
        dev.copy_engine.copy_async(y, host).wait()
        assert np.array_equal(host, np.arange(1 << 20, dtype=np.float32))
        assert bool((y == x).all())
        with route_cupy_allocations(pool):
            t = x * 2
            inside = dev.base_ptr <= t.data.ptr < dev.base_ptr + dev.capacity
            del t
        assert inside, "a CuPy temporary was not routed into the arena"
        return {"copy_engine_busy_s": dev.copy_engine.busy_s,
                "link_GBps": dev.copy_engine.total_bytes / max(dev.copy_engine.busy_s, 1e-12)
                / 1e9, "outside_arena": dev.outside_arena()}


def training_equals_cpu(model: str) -> dict:
    import minidl
    from minidl.net.optim import SGD
    from minidl.zoo.models import resnet, smallcnn
    from minidl.zoo.rnn import char_rnn

    rng = np.random.default_rng(0)
    if model == "smallcnn":
        make = smallcnn
        x, y = rng.standard_normal((8, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, 8)
    elif model == "resnet8":
        make = lambda: resnet(8, (3, 32, 32), 10)  # noqa: E731
        x, y = rng.standard_normal((8, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 8)
    else:
        make = lambda: char_rnn(65, 32, 64, cell="lstm")  # noqa: E731
        x = rng.integers(0, 65, (4, 16))
        y = np.roll(x, -1, axis=1)
    if DEVICE == "cuda":
        import cupy as cp

        cp.get_default_memory_pool().free_all_blocks()
    out: dict = {}
    for device in ("cpu", DEVICE):
        net = make()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                            memory="reuse,inplace", device=device, device_memory="512MiB")
        losses = [tr.step(x, y) for _ in range(2)]
        losses.append(float(tr.step(x, y, wait=False)))
        out[device] = losses
        if device != "cpu":
            rep = tr.memory_report()
            out["scratch_bytes"] = rep.get("device_temporaries", {}).get("scratch_bytes")
            out["outside_arena"] = rep.get("outside_arena")
            out["escaped_arena_bytes"] = int(cp.get_default_memory_pool().total_bytes()) \
                if DEVICE == "cuda" else tr.device.default_pool_peak
        tr.close()
    out["max_abs_loss_difference"] = float(np.max(np.abs(np.subtract(out["cpu"], out[DEVICE]))))
    assert out["max_abs_loss_difference"] < 1e-4, out
    assert out["escaped_arena_bytes"] == 0, "temporaries went to CuPy's own pool"
    return out


def cupy_ops() -> dict:
    if DEVICE != "cuda":
        return "cuda only"
    import cupy as cp

    return {"sum": float((cp.arange(1 << 20, dtype=cp.float32) * 2).sum()),
            "matmul": float((cp.ones((256, 256), cp.float32) @
                             cp.ones((256, 256), cp.float32))[0, 0])}


def main() -> None:
    check("cupy", cupy_ops)
    check("import minidl", lambda: __import__("minidl").__file__)
    launch_cases()
    check("device", device_basics)
    for model in ("smallcnn", "resnet8", "char-lstm"):
        check(f"train:{model}", lambda model=model: training_equals_cpu(model))
    failed = [k for k, v in results["checks"].items() if not v["ok"]]
    print(f"{len(results['checks']) - len(failed)} of {len(results['checks'])} checks passed"
          + (f"; failed: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
