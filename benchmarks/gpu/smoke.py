"""Every kind of launch minidl makes, first and smallest, on the GPU; one JSON object per check
in argv[1] (rewritten after each, so a crash leaves what ran).

* every ``CUDA_LAUNCH_CASES`` case of tests/kernels (each CUDA kernel of minidl against its
  NumPy / CPU reference, on arrays the cases normally emulate): here on real CuPy arrays, in
  GPUCHECK_WORKERS parallel processes (default: the cores, at most 8), which compile the
  kernels side by side (into Numba's disk cache where MINIDL_CUDA_CACHE=1, for the later
  stages); they end before anything below runs, so nothing else is on the GPU then;
* the device: the arena, views, copies both ways, CuPy's temporaries routed into the arena,
  the bytes outside it;
* three training steps of smallcnn, resnet8 and char-lstm on the GPU against the CPU's, with
  no host synchronisation inside a step that does not wait, and CuPy's own pool empty.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

OUT = ""  # (argv[1], set by main: the module is imported by its workers and tests too)
REPO = Path(__file__).resolve().parents[2]
#: The device the check runs on (cuda; cuda-strict: the strict test device, on the CPU).
DEVICE = os.environ.get("GPUCHECK_DEVICE", "cuda")
results: dict = {"checks": {}, "device": DEVICE}


def attempt(fn) -> dict:
    """``fn()``'s outcome: ok and its value, or the error and traceback; its seconds."""
    t0 = time.perf_counter()
    try:
        r = {"ok": True, "value": fn()}
    except BaseException as e:  # noqa: BLE001 -- a finding, not a crash
        r = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
             "traceback": traceback.format_exc()[-4000:]}
    r["seconds"] = round(time.perf_counter() - t0, 3)
    return r


def record(name: str, r: dict) -> None:
    results["checks"][name] = r
    print(name, "ok" if r["ok"] else "FAILED " + r["error"][:300], f"({r['seconds']} s)",
          flush=True)
    if OUT:
        with open(OUT, "w") as f:
            json.dump(results, f, indent=1, default=str)


def check(name: str, fn) -> None:
    record(name, attempt(fn))


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


KERNEL_TESTS = REPO / "tests" / "kernels"


def _load(path: Path):
    """A kernel test module holding ``CUDA_LAUNCH_CASES``."""
    if str(KERNEL_TESTS) not in sys.path:  # (their shared emulated arrays, as its conftest.py)
        sys.path.insert(0, str(KERNEL_TESTS))
    spec = importlib.util.spec_from_file_location(f"_gpucheck_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case_list() -> list[tuple[str, str]]:
    """``(module path, case name)`` of every launch case (the first of each module only with
    GPUCHECK_QUICK=1: the check's own test covers the plumbing, not every kernel)."""
    cases = []
    for path in sorted(KERNEL_TESTS.glob("test_*.py")):
        if "\nCUDA_LAUNCH_CASES = " not in path.read_text():
            continue
        names = list(_load(path).CUDA_LAUNCH_CASES)
        if os.environ.get("GPUCHECK_QUICK") == "1":
            names = names[:1]
        cases += [(str(path), name) for name in names]
    return cases


_MODULES: dict = {}


def run_case(path: str, name: str) -> dict:
    """One launch case, its device arrays made CuPy's (D: to the device, H: back to the host):
    the outcome as :func:`attempt` gives it. Runs in a worker process."""
    def run() -> str:
        from minidl.kernels._cuda import set_disk_cache
        from minidl.settings import Settings

        set_disk_cache(Settings.from_environment().cuda_disk_cache)  # (MINIDL_CUDA_CACHE)
        if path not in _MODULES:
            mod = _MODULES[path] = _load(Path(path))
            mod.D, mod.H, mod._gpucheck_sync = _transfers()
        mod = _MODULES[path]
        with np.errstate(invalid="ignore"):
            mod.CUDA_LAUNCH_CASES[name](np.random.default_rng(0))
        mod._gpucheck_sync()
        return "equal to the reference"
    return attempt(run)


def workers() -> int:
    return max(1, int(os.environ.get("GPUCHECK_WORKERS") or min(8, os.cpu_count() or 1)))


def launch_cases() -> None:
    """Every launch case in :func:`workers` spawned processes (CUDA does not survive a fork);
    a worker that dies fails the cases it had."""
    cases = case_list()
    results["launch_workers"] = workers()
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers(), mp_context=ctx) as pool:
        futures = [(f"launch:{Path(p).stem}.{n}", pool.submit(run_case, p, n)) for p, n in cases]
        for name, fut in futures:
            try:
                r = fut.result()
            except BaseException as e:  # noqa: BLE001 -- a worker died: a finding
                r = {"ok": False, "error": f"worker: {type(e).__name__}: {e}"[:2000],
                     "seconds": None}
            record(name, r)


def link_figures(engine) -> dict:
    """The copy engine's link rate over the copies that have completed: every queued copy is
    waited for and retired first (a copy only waited for, ``event.wait()``, is not yet counted
    in ``busy_s``; ``total_bytes`` counts copies still in flight)."""
    engine.synchronize()
    nbytes, busy = engine.retired()
    return {"copied_bytes": nbytes, "copy_engine_busy_s": busy,
            "link_GBps": nbytes / busy / 1e9 if nbytes and busy > 0 else None}


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
        return {**link_figures(dev.copy_engine), "outside_arena": dev.outside_arena()}


#: Unit roundoff of the mixed precisions' half dtypes (their loss tolerance against the CPU).
HALF_EPS = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}


def training_equals_cpu(model: str, precision: str = "fp32") -> dict:
    """Three steps of ``model`` on the CPU and the device in ``precision``: equal losses (to
    1e-4 in fp32; to one half unit roundoff, relative, in a mixed precision) and no temporary
    outside the arena."""
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
                            memory="reuse,inplace", device=device, device_memory="512MiB",
                            precision=precision)
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
    bound = HALF_EPS[precision] * float(np.max(np.abs(out["cpu"]))) \
        if precision in HALF_EPS else 1e-4
    assert out["max_abs_loss_difference"] <= bound, out
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
    global OUT
    OUT = sys.argv[1]
    check("cupy", cupy_ops)
    check("import minidl", lambda: __import__("minidl").__file__)
    launch_cases()
    check("device", device_basics)
    for model in ("smallcnn", "resnet8", "char-lstm"):
        check(f"train:{model}", lambda model=model: training_equals_cpu(model))
    for precision in HALF_EPS:  # the mixed-precision path on the device (mixed_steps)
        check(f"train:smallcnn:{precision}",
              lambda precision=precision: training_equals_cpu("smallcnn", precision))
    failed = [k for k, v in results["checks"].items() if not v["ok"]]
    print(f"{len(results['checks']) - len(failed)} of {len(results['checks'])} checks passed"
          + (f"; failed: {failed}" if failed else ""))


if __name__ == "__main__":
    main()
