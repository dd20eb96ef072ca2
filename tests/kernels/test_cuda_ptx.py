"""Every Numba CUDA kernel of minidl.kernels compiles to PTX for real GPUs: the oldest target
the installed NVVM takes (sm_70 with CUDA 12, sm_75 with CUDA 13) and sm_90.

The signatures are the ones the kernels are launched with: the emulated launches of the
``CUDA_LAUNCH_CASES`` of test_cuda_launch.py and of any other test module here defining them
(every public CUDA entry point, every dtype it is used with) are recorded, and each recorded
``(kernel, argument types)`` is compiled with ``numba.cuda.compile_ptx`` for each compute
capability. Numba types a Numba/CuPy device array
argument exactly as it types the host buffer of an emulated one (C-contiguous, aligned), so the
recorded signatures are those of a GPU run. No GPU is needed: NVVM and libdevice come from the
CUDA toolkit wheels of the ``cuda`` extra; without numba-cuda installed the tests skip.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest

from minidl.kernels import _cuda
from minidl.kernels.codecs import sparse

# the oldest and the newest target (sm_80 lies between them; each arch costs ~7 s of CI): NVVM of
# CUDA 13 dropped sm_70 (its oldest is sm_75), so the oldest is the first one this NVVM takes
OLDEST_CANDIDATES = [(7, 0), (7, 5)]
NEWEST = (9, 0)

needs_numba_cuda = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None,
    reason="numba-cuda is not installed (pip install minidl[test])")


def _launch_cases():
    """``CUDA_LAUNCH_CASES`` (name -> function of a NumPy generator launching kernels on
    emulated device arrays) of every test module of this folder and its sub-folders that
    defines them: test_cuda_launch.py's and those of the kernel families' own test files."""
    cases = {}
    for path in sorted(Path(__file__).parent.rglob("test_*.py")):
        if path.name == Path(__file__).name or "\nCUDA_LAUNCH_CASES = " not in path.read_text():
            continue
        spec = importlib.util.spec_from_file_location(f"_minidl_cases_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        cases.update({f"{path.stem}.{k}": v for k, v in mod.CUDA_LAUNCH_CASES.items()})
    return cases


def _all_kernel_functions() -> set:
    """Every ``_k_*`` function defined in a module of minidl.kernels (its sub-packages
    included)."""
    found = set()
    pkg = importlib.import_module(_cuda.__package__)
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_k_") and inspect.isfunction(obj) and \
                    obj.__module__ == mod.__name__:
                found.add(obj)
    return found


@pytest.fixture(scope="module")
def launched() -> dict:
    """``{(kernel, argument types)}`` of every launch the emulated cases make."""
    from numba import typeof, types

    seen: dict = {}
    original = _cuda.Kernel.emulate

    def record(self, *args):
        sig = []
        for a in args:
            t = typeof(a.__emulated_device_buffer__() if _cuda._emulated(a) else a)
            if isinstance(t, types.Array):  # as Numba types a device array
                t = types.Array(t.dtype, t.ndim, t.layout)
            sig.append(t)
        seen.setdefault((self, tuple(sig)), None)
        return original(self, *args)

    mp = pytest.MonkeyPatch()
    mp.setattr(_cuda.Kernel, "emulate", record)
    try:
        with np.errstate(invalid="ignore"):
            for case in _launch_cases().values():
                case(np.random.default_rng(1))
    finally:
        mp.undo()
    return seen


def test_every_kernel_is_launched_by_the_cases(launched):
    kernels = _all_kernel_functions()
    assert len(kernels) >= 15, kernels  # the scan, bitpack, poolidx, sparse, precision, pool
    missing = kernels - {k.py_func for k, _ in launched}
    assert not missing, f"kernels no case launches: {sorted(f.__qualname__ for f in missing)}"


def _unreachable_signatures() -> list:
    """Launch signatures the cases cannot reach: csr row pointers are int64 from 2**31
    elements on."""
    from numba import types as t

    k, a = sparse._kernels(), (lambda d: d[::1])
    out = []
    for u in (t.uint32, t.uint64):
        for col in (t.uint8, t.uint16):
            out.append((k.k_csr_encode, (a(u), a(t.int64), a(u), a(col), t.int64, t.int64, u)))
            out.append((k.k_csr_decode, (a(u), a(col), a(t.int64), a(u), t.int64, t.int64, u)))
    return out


def oldest_supported_cc() -> tuple[int, int]:
    """The oldest compute capability of OLDEST_CANDIDATES this NVVM compiles for."""
    from numba import types

    probe = _cuda._kernels().k_fill_probe
    for cc in OLDEST_CANDIDATES:
        try:
            _cuda.compile_ptx(probe, (types.float32[::1], types.float32), cc)
            return cc
        except Exception:  # noqa: BLE001 -- NVVM refuses the architecture
            continue
    pytest.fail(f"NVVM compiles for none of {OLDEST_CANDIDATES}")


@needs_numba_cuda
def test_oldest_target_follows_nvvm():
    """sm_70 with NVVM of CUDA 12, sm_75 with NVVM of CUDA 13 (which rejects sm_70)."""
    from numba import types

    cc = oldest_supported_cc()
    ptx = _cuda.compile_ptx(_cuda._kernels().k_fill_probe, (types.float32[::1], types.float32),
                            cc)
    isa = next(ln.split()[1] for ln in ptx.splitlines() if ln.startswith(".version"))
    assert cc == ((7, 5) if int(isa.split(".")[0]) >= 9 else (7, 0)), (cc, isa)


@needs_numba_cuda
@pytest.mark.parametrize("which", ["oldest", "newest"])
def test_every_launched_signature_compiles_to_ptx(launched, which):
    cc = oldest_supported_cc() if which == "oldest" else NEWEST
    target = f".target sm_{cc[0]}{cc[1]}"
    for kernel, sig in list(launched) + _unreachable_signatures():
        ptx = _cuda.compile_ptx(kernel, sig, cc)
        assert target in ptx.splitlines(), (kernel, sig)
        entries = [ln for ln in ptx.splitlines() if ".entry" in ln]
        assert len(entries) == 1 and kernel.py_func.__name__ in entries[0], (kernel, sig)
