"""The CUDA decoder of compressed weight records (kernels/compression/weight_record.py) without a
GPU.

Three checks, as for the other CUDA kernels: the Numba CUDA simulator (a subprocess with
``NUMBA_ENABLE_CUDASIM=1``: the grid-stride pass on 4 x 32 threads, the decoding thread on a
launch of its own), the emulated one-thread launch on CuPy-like arrays (malformed records:
the status byte says what is wrong, :func:`check` refuses the same records on the host), and
the PTX of the decoding kernel (no local memory, its tables within a block's 48 KiB of static
shared memory). Results are compared bit for bit with the NumPy reference decoder.
test_cuda_launch.py's ``weight_record`` case gives the launch signatures test_cuda_ptx.py
compiles for sm_70/80/90.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from minidl.kernels import _cuda
from minidl.kernels.compression import huffman
from minidl.kernels.compression import weight_record as wr


def _launch_helpers():
    spec = importlib.util.spec_from_file_location(
        "_minidl_cuda_launch_helpers", Path(__file__).parent.parent / "test_cuda_launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


L = _launch_helpers()
D, H, same = L.D, L.H, L.same


def _shared(n: int, k: int, vb: int, ib: int, density: float, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    codes = rng.integers(1, k + 1, n) * (rng.random(n) < density)
    return wr.shared_record(codes, rng.standard_normal(k).astype(np.float32), vb, ib)


def _device_decode(rec: bytes, n: int, dtype=np.float32) -> tuple[np.ndarray, int]:
    out, st = D(np.full(n, 7, dtype)), D(np.full(1, 9, np.uint8))
    wr.decode_into(D(np.frombuffer(rec, np.uint8)), out, status=st)
    return H(out), int(H(st)[0])


# ----------------------------------------------------------------------------- simulator
SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import config, cuda
    from minidl.kernels import _cuda
    from minidl.kernels.compression import weight_record as wr
    assert config.ENABLE_CUDASIM and _cuda.grid(10**6) == (4, 32)
    rng = np.random.default_rng(0)
    D, H = cuda.to_device, (lambda a: a.copy_to_host())
    cases = [  # (shape, k, value bits, index bits, density)
        ((6, 1, 5, 5), 15, 4, 3, 0.3),   # a conv kernel, fillers (gaps > 7)
        ((30, 41), 30, 5, 1, 0.05),      # mostly fillers (1-bit gaps)
        ((9,), 1, 1, 1, 1.0),            # single-symbol streams (every gap 0, one value)
        ((50,), 3, 2, 2, 0.0),           # all zeros: no entries, empty streams
        ((0,), 1, 1, 1, 0.0),            # an empty tensor
        ((1,), 1, 1, 1, 1.0),            # one entry
        ((7, 3), 255, 8, 12, 0.9),       # the widest index code (4096 symbols)
    ]
    for shape, k, vb, ib, dens in cases:
        codes = rng.integers(1, k + 1, shape) * (rng.random(shape) < dens)
        rec = wr.shared_record(codes, rng.standard_normal(k).astype(np.float32), vb, ib)
        ref = wr.decode_reference(rec).reshape(-1)
        n = ref.size
        for dt in (np.float32, np.float64):
            for status in (np.full(1, 9, np.uint8), None):
                out = D(np.full(n, 7, dt))
                st = None if status is None else D(status)
                wr.decode_into(D(np.frombuffer(rec, np.uint8).copy()), out, status=st)
                got, want = H(out), ref.astype(dt)
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (shape, dt)
                assert st is None or H(st)[0] == 0
    for dt in wr.RAW_DTYPES:  # raw records: a byte copy (more bytes than the 128 threads)
        vals = (rng.standard_normal(301) * 100).astype(dt)
        out, st = D(np.zeros(301, dt)), D(np.full(1, 9, np.uint8))
        wr.decode_into(D(np.frombuffer(wr.raw_record(vals), np.uint8).copy()), out, status=st)
        assert np.array_equal(H(out).view(np.uint8), vals.view(np.uint8)) and H(st)[0] == 0
    rec = wr.shared_record(np.arange(40) % 3, np.float32([0.5, -2]), 2, 2)
    out, st = D(np.zeros(40, np.float32)), D(np.full(1, 9, np.uint8))
    wr.decode_into(D(np.frombuffer(rec[:-1], np.uint8).copy()), out, status=st)
    assert H(st)[0] == 2  # a truncated stream is reported
    print("SIM OK")
""")


def test_decoder_under_the_simulator():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    r = subprocess.run([sys.executable, "-c", SIM_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "SIM OK" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- emulated
@pytest.mark.parametrize("n,k,vb,ib,density", [
    (0, 1, 1, 1, 0.0), (1, 1, 1, 1, 1.0), (333, 1, 1, 1, 1.0), (333, 1, 3, 2, 0.0),
    (1000, 7, 3, 3, 0.1), (4097, 31, 5, 4, 0.3), (2000, 4095, 12, 12, 0.5)])
def test_emulated_decoder_bit_equal_to_the_reference(n, k, vb, ib, density):
    rec = _shared(n, k, vb, ib, density)
    for dt in (np.float32, np.float64):
        got, status = _device_decode(rec, n, dt)
        assert status == 0
        same(got, wr.decode_reference(rec).reshape(-1).astype(dt))
    host = np.full(n, 7, np.float32)
    wr.decode_into(rec, host)
    same(host, _device_decode(rec, n)[0])
    assert wr.check(rec, np.float32).kind == wr.SHARED


def _patched(rec: bytes, pos: int, data: bytes) -> bytes:
    return rec[:pos] + data + rec[pos + len(data):]


def _malformed() -> list[tuple[str, bytes, int, object, int, str]]:
    """(what, record, destination size, dtype, status code, the host check's message)."""
    rec = wr.shared_record(np.arange(100) % 3, np.float32([0.5, -2]), 2, 2)  # last entry at 99
    lengths_at = 2 + 4 + 8 + 4 * 2  # one dim; the value code's 5-bit lengths follow
    all_ones = huffman.pack_lengths(np.ones(4, np.uint8))  # Kraft sum 2: no prefix code
    raw = wr.raw_record(np.arange(10, dtype=np.float32))
    return [
        ("truncated stream", rec[:-1], 100, np.float32, 2, "invalid after"),
        ("entries past the end", _patched(rec, 2, struct.pack("<I", 50)), 50, np.float32, 3,
         "invalid after"),
        ("value bits 13", _patched(rec, 6, b"\x0d"), 100, np.float32, 1, "header is invalid"),
        ("not a prefix code", _patched(rec, lengths_at, all_ones), 100, np.float32, 1,
         "invalid code table"),
        ("shared into int64", rec, 100, np.int64, 1, "float32 or float64"),
        ("raw float32 into float64", raw, 10, np.float64, 1, "the destination is float64"),
        ("unknown kind", _patched(raw, 0, b"\x07"), 10, np.float32, 1, "unknown weight record"),
    ]


@pytest.mark.parametrize("what,rec,n,dtype,code,message", _malformed(),
                         ids=[m[0] for m in _malformed()])
def test_malformed_records_status_and_host_check(what, rec, n, dtype, code, message):
    got, status = _device_decode(rec, n, dtype)
    assert status == code, (what, wr.STATUS.get(status))
    assert np.isfinite(got.astype(np.float64)).all()  # nothing written outside, no garbage
    with pytest.raises(wr.RecordError, match=message):
        wr.check(rec, dtype)


def test_size_mismatch_and_bad_arguments():
    rec = _shared(300, 7, 3, 3, 0.2)
    assert _device_decode(rec, 299)[1] == 1  # the destination is not the record's size
    assert _device_decode(wr.raw_record(np.ones(5, np.float32)), 6)[1] == 1
    with pytest.raises(ValueError, match="flat uint8"):
        wr.decode_into(D(np.zeros(4, np.int32)), D(np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="status must be a uint8"):
        wr.decode_into(D(np.frombuffer(rec, np.uint8)), D(np.zeros(300, np.float32)),
                       status=D(np.zeros(1, np.int32)))
    with pytest.raises(TypeError, match="mix"):
        wr.decode_into(D(np.frombuffer(rec, np.uint8)), np.zeros(300, np.float32))
    with pytest.raises(ValueError, match="status is for device decoding"):
        wr.decode_into(rec, np.zeros(300, np.float32), status=np.zeros(1, np.uint8))


def test_host_impls_agree():
    rec = _shared(777, 13, 4, 3, 0.25)
    a, b = np.zeros(777, np.float32), np.zeros(777, np.float32)
    wr.decode_into(rec, a, impl="numba")
    wr.decode_into(rec, b, impl="numpy")
    same(a, b)


# ----------------------------------------------------------------------------- PTX
needs_numba_cuda = pytest.mark.skipif(
    importlib.util.find_spec("numba_cuda") is None,
    reason="numba-cuda is not installed (pip install minidl[test])")


@needs_numba_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_decoding_kernel_uses_no_local_memory(dtype):
    """The one decoding thread keeps its tables in shared memory: large local arrays would
    make the driver reserve local memory for every thread the GPU can hold."""
    from numba import types as t

    def arr(d):
        return d[::1]

    ptx = _cuda.compile_ptx(wr._kernels().k_decode_shared,
                            (arr(t.uint8), arr(getattr(t, dtype)), arr(t.uint8), t.boolean),
                            (8, 0))
    assert ".local" not in ptx
    shared = [int(line.rsplit("[", 1)[1].split("]")[0]) for line in ptx.splitlines()
              if line.startswith(".visible .shared")]
    assert 4096 * (1 + 2 + 2 + 4) <= sum(shared) <= 48 * 1024, shared
