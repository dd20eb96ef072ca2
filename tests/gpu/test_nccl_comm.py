"""minidl.distributed.comm.NcclCommunicator on 2 GPUs: 2 MPI ranks, one GPU each, every collective
checked
against its definition, and the collectives of unequal chunks (ZeRO's reduce_scatter_v and
allgather_v) against the MPI communicator's results on the same host arrays (skipped without
CUDA, NCCL in CuPy, 2 GPUs or MPI)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import cupy as cp, numpy as np
from minidl.distributed.comm import MpiCommunicator, NcclCommunicator
c = NcclCommunicator(MpiCommunicator(timeout_s=60))
r, n = c.rank, c.size
with cp.cuda.Device(c.device):
    a = cp.arange(6, dtype=cp.float32) + r
    c.allreduce(a)
    ok = [bool(cp.all(a == sum(cp.arange(6, dtype=cp.float32) + k for k in range(n))))]
    send = cp.arange(2 * n, dtype=cp.float32) * (r + 1)
    out = cp.empty(2, dtype=cp.float32)
    c.reduce_scatter(send, out)
    ok.append(bool(cp.all(out == cp.arange(2 * r, 2 * r + 2) * sum(range(1, n + 1)))))
    full = cp.empty(2 * n, dtype=cp.float32)
    c.allgather(cp.full(2, r, dtype=cp.float32), full)
    ok.append(bool(cp.all(full == cp.repeat(cp.arange(n, dtype=cp.float32), 2))))
    b = cp.full(3, r + 7.0, dtype=cp.float64)
    c.broadcast(b, root=1)
    ok.append(bool(cp.all(b == 8.0)))
    c.barrier()
print(r, all(ok), ok)
"""


UNEQUAL_CHUNKS_SCRIPT = r"""
import cupy as cp, numpy as np
from minidl.distributed.comm import MpiCommunicator, NcclCommunicator
mpi = MpiCommunicator(timeout_s=60)
c = NcclCommunicator(mpi)
r, n = c.rank, c.size
ok = []
with cp.cuda.Device(c.device):
    for counts in ([3] + [1] * (n - 1), [0] * (n - 1) + [4]):
        send = np.arange(sum(counts), dtype=np.float32) * (r + 1)
        want = np.empty(counts[r], dtype=np.float32)
        mpi.reduce_scatter_v(send, want, counts)
        out = cp.empty(counts[r], dtype=cp.float32)
        c.reduce_scatter_v(cp.asarray(send), out, counts)
        ok.append(bool(np.array_equal(cp.asnumpy(out), want)))
        chunk = np.full(counts[r], r + 1.0, dtype=np.float32)
        want = np.empty(sum(counts), dtype=np.float32)
        mpi.allgather_v(chunk, want, counts)
        full = cp.empty(sum(counts), dtype=cp.float32)
        c.allgather_v(cp.asarray(chunk), full, counts)
        ok.append(bool(np.array_equal(cp.asnumpy(full), want)))
    c.barrier()
print(r, all(ok), ok)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("script_text", [SCRIPT, UNEQUAL_CHUNKS_SCRIPT],
                         ids=["collectives", "unequal_chunks_match_mpi"])
def test_nccl_on_two_gpus(tmp_path, script_text):
    import cupy
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("CuPy has no NCCL (pip install nvidia-nccl-cu12)")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("NCCL needs one GPU per rank: fewer than 2 GPUs")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed")
    path = Path(__file__).parents[1] / "minidl" / "test_data_parallel.py"
    spec = importlib.util.spec_from_file_location("test_data_parallel", path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    script = tmp_path / "nccl_check.py"
    script.write_text(script_text)
    res = subprocess.run([*helpers._mpiexec(), sys.executable, str(script)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(line.split()[:2] for line in helpers._printed_lines(res.stdout)) == [
        ["0", "True"], ["1", "True"]], res.stdout
