"""What the GPU machine has, as JSON (argv[1]): Python and packages, CuPy and the GPU, Numba's
CUDA toolchain (NVVM, libdevice, the driver's CUDA), PyTorch; and two verdicts the check reads:
``gpu_ok`` (minidl imports and CuPy sees a GPU) and ``nvvm_ok`` (a Numba CUDA kernel compiles,
loads and runs there), with ``problems`` saying what is wrong."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import io
import json
import platform
import sys


def guarded(info: dict, key: str, fn) -> None:
    try:
        info[key] = fn()
    except BaseException as e:  # noqa: BLE001 -- everything is a finding here
        info[key + "_error"] = f"{type(e).__name__}: {e}"[:1500]


def packages() -> dict:
    keep = ("cupy", "numba", "nvidia-", "cuda-", "torch", "numpy", "scipy", "llvmlite", "pytest",
            "hypothesis", "minidl", "mpi4py")
    names = sorted({d.metadata["Name"] for d in md.distributions() if d.metadata["Name"]},
                   key=str.lower)
    return {n: md.version(n) for n in names if n.lower().startswith(keep)}


def cupy_info() -> dict:
    import cupy as cp

    d = {"version": cp.__version__, "available": bool(cp.cuda.is_available())}
    if not d["available"]:
        return d
    rt = cp.cuda.runtime
    d["runtime_version"] = rt.runtimeGetVersion()
    d["driver_version"] = rt.driverGetVersion()
    props = rt.getDeviceProperties(0)
    d["device"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    d["compute_capability"] = cp.cuda.Device(0).compute_capability
    d["multiprocessors"] = props.get("multiProcessorCount")
    d["mem_free"], d["mem_total"] = rt.memGetInfo()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cp.show_config()
    d["show_config"] = buf.getvalue()
    return d


def numba_info() -> dict:
    import numba

    d = {"numba": numba.__version__}
    guarded(d, "numba_cuda", lambda: md.version("numba-cuda"))
    from numba.cuda.cudadrv import libs, nvvm

    guarded(d, "nvvm_api_version", lambda: nvvm.NVVM().get_version())
    guarded(d, "libdevice", libs.get_libdevice)
    try:
        with open("/proc/self/maps") as f:
            d["nvvm_loaded_from"] = sorted({ln.split()[-1] for ln in f if "libnvvm" in ln})
    except OSError:
        pass
    return d


def torch_info() -> dict:
    import torch

    d = {"version": torch.__version__, "cuda": torch.version.cuda,
         "available": torch.cuda.is_available()}
    if d["available"]:
        d["cudnn"] = torch.backends.cudnn.version()
    return d


def main(out: str) -> None:
    info: dict = {"python": sys.version, "executable": sys.executable,
                  "platform": platform.platform(), "problems": []}
    guarded(info, "packages", packages)
    cupys = [n for n in info.get("packages", {}) if n.lower().startswith("cupy-cuda")]
    if len(cupys) > 1:
        info["problems"].append(f"several CuPy distributions installed: {cupys}")
    guarded(info, "minidl", lambda: __import__("minidl").__version__)
    guarded(info, "cupy", cupy_info)
    guarded(info, "numba", numba_info)
    guarded(info, "torch", torch_info)
    gpu = isinstance(info.get("cupy"), dict) and info["cupy"].get("available", False)
    info["gpu_ok"] = bool(gpu and "minidl" in info)
    if "minidl_error" in info:
        info["problems"].append(f"minidl does not import: {info['minidl_error']}")
    if not gpu:
        info["problems"].append("CuPy sees no GPU: " + str(info.get("cupy_error") or
                                                           "cupy.cuda.is_available() is false"))
        info["nvvm_ok"] = False
    else:
        from minidl.kernels._cuda import toolchain_problem

        problem = toolchain_problem()
        info["nvvm_ok"] = problem is None
        if problem is not None:
            info["problems"].append(f"Numba CUDA cannot run a kernel: {problem}")
        guarded(info["numba"], "driver_cuda", lambda: __import__(
            "numba.cuda.cudadrv.driver", fromlist=["x"]).get_version())
        info["gpu_ok"] = info["gpu_ok"] and info["nvvm_ok"]
    with open(out, "w") as f:
        json.dump(info, f, indent=1, default=str)
    short = {k: info.get(k) for k in ("gpu_ok", "nvvm_ok", "problems")}
    print(json.dumps(short, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
