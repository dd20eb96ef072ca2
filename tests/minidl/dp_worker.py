"""Worker of tests/minidl/distributed/test_data_parallel.py, run as
``mpiexec -n 2 python dp_worker.py OUT`` (every rank trains; rank 0 saves losses and parameters
to OUT/<case>.npz), and imported by the test for the single-process reference (:func:`train`
with ``SingleProcess``).

``python dp_worker.py OUT --mismatch``: the ranks ask for different memory specs; each prints
the error it gets and exits with status 3. ``--fail``: rank 1 raises at its third step; rank 0
must give up waiting (a 10 s collective timeout) and abort the job.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from minidl.analysis.dryrun import dry_run
from minidl.analysis.estimate import estimate_table
from minidl.distributed.comm import MpiCommunicator
from minidl.memory.ir.config import MemoryConfig
from minidl.net.optim import SGD, Adam
from minidl.train.trainer import Trainer
from minidl.zoo import models

#: (case name, memory spec, the single-process reference's spec, global batch, bucket bytes):
#: small buckets give several buckets launched during backward; a batch of 15 gives shards of
#: 8 and 7 rows, a batch of 1 leaves rank 1 none; zero=1 shards SGD's momentum, also beside
#: swapping and recomputation; zero=2 also the gradients (buckets reduce-scattered), with
#: several buckets, beside swapping and recomputation, and on a rank without rows; zero=3 also
#: the parameters (gathered per step), likewise (every rank needs rows: it joins the gathers).
CASES = (("none", "none", "none", 16, 1024),
         ("reuse_inplace", "reuse,inplace", "reuse,inplace", 16, 1024),
         ("uneven", "none", "none", 15, 1 << 20),
         ("one_sample", "none", "none", 1, 1 << 20),
         ("zero1", "reuse,inplace,zero=1", "reuse,inplace", 16, 1024),
         ("swap_recompute_zero1", "reuse,swap=all,recompute=sqrt,zero=1",
          "reuse,swap=all,recompute=sqrt", 16, 1024),
         ("zero2", "reuse,inplace,zero=2", "reuse,inplace", 16, 1024),
         ("none_zero2", "none,zero=2", "none", 15, 1 << 20),
         ("swap_recompute_zero2", "reuse,swap=all,recompute=sqrt,zero=2",
          "reuse,swap=all,recompute=sqrt", 16, 1024),
         ("one_sample_zero2", "reuse,zero=2", "reuse", 1, 1024),
         ("zero3", "reuse,inplace,zero=3", "reuse,inplace", 16, 1024),
         ("swap_recompute_zero3", "reuse,swap=all,recompute=sqrt,zero=3",
          "reuse,swap=all,recompute=sqrt", 15, 1024),
         ("none_zero3", "none,zero=3", "none", 15, 1 << 20))
#: A network with BatchNorm (resnet8 3x8x8, width 2) on 2 ranks, with ``sync_bn`` (equal to one
#: process; also under zero=3) and without (each rank normalises with its own shard's
#: statistics: not equal): (case name, sync_bn, memory spec).
BN_CASES = (("sync_bn", True, "reuse,inplace"), ("per_rank_bn", False, "reuse,inplace"),
            ("sync_bn_zero3", True, "reuse,inplace,zero=3"))
#: Mixed precision on 2 ranks (``precision`` of the Trainer and of the plan): plain data
#: parallelism matches one process within half rounding; every ZeRO stage gives its bits.
#: (case name, memory spec, precision, global batch, bucket bytes).
MIXED_CASES = (("bf16_reuse_inplace", "reuse,inplace", "bf16-mixed", 16, 1024),
               ("bf16_zero2", "reuse,inplace,zero=2", "bf16-mixed", 16, 1024),
               ("bf16_zero3", "reuse,inplace,zero=3", "bf16-mixed", 16, 1024),
               ("fp16_reuse_inplace", "reuse,inplace", "fp16-mixed", 16, 1024),
               ("fp16_zero2", "reuse,inplace,zero=2", "fp16-mixed", 16, 1024))
#: offload=optimizer and offload=parameters on 2 ranks (the gradients averaged in the host's
#: landing buffers) with Adam, beside plain data parallelism on the device in the same
#: precision, whose bits they give: (case name, memory spec, precision); global batch 15
#: (shards of 8 and 7 rows), 1 KiB buckets; fp16's loss scale starts at OFFLOAD_FP16_SCALE, so
#: that the first steps overflow and are skipped (on every rank: the ranks test the all-reduced
#: gradients; under zero=2 each its shards, the verdicts all-reduced). offload=optimizer with
#: zero=1 and zero=2: each rank's host keeps its owned ranges of the state.
OFFLOAD_CASES = tuple((f"{name}_{p.split('-')[0]}", spec, p)
                      for p in ("fp32", "bf16-mixed", "fp16-mixed")
                      for name, spec in (("adam_device", "reuse,inplace"),
                                         ("adam_offload", "reuse,inplace,offload=optimizer"),
                                         ("adam_stream", "reuse,inplace,offload=parameters"),
                                         ("adam_offload_zero1",
                                          "reuse,inplace,offload=optimizer,zero=1"),
                                         ("adam_offload_zero2",
                                          "reuse,inplace,offload=optimizer,zero=2")))
#: Saved after RESUME_AT steps and resumed by a new trainer (same case names and specs): the
#: bits of the straight run.
RESUME_CASES = (("adam_offload_zero2_bf16_resumed", "reuse,inplace,offload=optimizer,zero=2",
                 "bf16-mixed"),)
RESUME_AT = 4
OFFLOAD_FP16_SCALE = 2.0 ** 24
STEPS = 10
#: Runs every rank must refuse in one line: the flag, and each rank's memory spec (ranks that
#: disagree on the spec).
REFUSED_SPECS = {"--mismatch": ("none", "reuse")}


def _net(bn: bool):
    return models.resnet(8, (3, 8, 8), 10, width=2) if bn else models.smallcnn(
        (1, 8, 8), 10, width=4)


def train(comm, spec: str, batch: int, bucket_bytes: int, fail_at: int | None = None,
          bn: bool = False, sync_bn: bool = False, precision: str = "fp32",
          optimizer: str = "sgd", loss_scale: float | None = None,
          resume: Path | None = None) -> dict[str, np.ndarray]:
    """Ten SGD (or ``adam``) steps of a small smallcnn (``bn``: resnet8) on one seeded global
    batch: losses, parameters, optimizer state, rank 0's real and planned peaks, each rank's
    host state bytes by kind and the number of buckets (``fp16-mixed``: also the steps its loss
    scaler, starting at ``loss_scale`` when given, skipped); ``resume``: saved there after
    RESUME_AT steps and resumed by a new trainer."""
    shape = _net(bn).input_shapes[0]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)

    def make():
        net = _net(bn)
        opt = SGD(net.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd" else \
            Adam(net.parameters(), lr=0.01)
        return net, Trainer(net, opt, memory=spec, device_memory="16MiB", comm=comm,
                            bucket_bytes=bucket_bytes, sync_bn=sync_bn, precision=precision)

    net, trainer = make()
    if loss_scale is not None:
        trainer.loss_scaler.scale = loss_scale
    losses = []
    for i in range(STEPS):
        if i == fail_at and comm.rank == 1:
            raise RuntimeError(f"rank 1 fails at step {i}")
        if resume is not None and i == RESUME_AT:
            trainer.save(resume)
            trainer.close()
            net, trainer = make()
            trainer.load(resume, resume=True)
        losses.append(trainer.step(x, y))
    out = {f"param/{k}": np.array(v) for k, v in net.state_dict().items()}
    out.update({f"optim/{k}": np.asarray(v) for k, v in trainer.optimizer.state_dict().items()})
    out["losses"] = np.array(losses)
    out["peak_allocated"] = np.array(trainer.pool.stats()["allocated_bytes.peak"])
    # the plan of rank 0 (made here: convolution workspaces depend on the thread count)
    plan = dry_run(_net(bn), batch, spec, optimizer, input_shape=shape, ranks=comm.size,
                   precision=precision)
    out["planned_peak"] = np.array(plan["peak_allocated_bytes"])
    out["planned_host"] = np.array(plan["host_state_bytes"])
    state = trainer.engine.host_state
    kinds = ("master", "gradient", "optimizer_state", "half_parameters")  # (rows: the ranks)
    out["host_by_kind"] = np.array(comm.allgather_object(
        [0] * len(kinds) if state is None else [state.by_kind().get(k, 0) for k in kinds]))
    out["alignment"] = np.array(trainer.pool.alignment)
    sync = None if trainer.parallel is None else trainer.parallel.sync
    out["bucket_host"] = np.array([0, 0] if sync is None else [  # (the ring's, the gradients')
        sync.host_bytes, sum(p.data.size * p.data.itemsize for p in sync.params)])
    if trainer.loss_scaler is not None:
        out["skipped"] = np.array(trainer.loss_scaler.skipped)
    # the same rank's row of minidl plan --ranks N --table (estimate_table)
    stage = MemoryConfig.parse(spec).zero
    rows = estimate_table(lambda: _net(bn), shape, batch, spec, [comm.size], optimizer,
                          stages=(stage,), precision=precision) if 1 < comm.size <= batch else []
    out["table_peak"] = np.array(rows[0].peak_allocated if rows else out["planned_peak"])
    out["buckets"] = np.array(0 if trainer.parallel is None else len(
        trainer.parallel.sync.buckets))
    trainer.close()
    return out


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    comm = MpiCommunicator(timeout_s=10)
    for flag, specs in REFUSED_SPECS.items():
        if flag in argv:  # each rank prints the one-line error it gets
            try:
                train(comm, specs[comm.rank], 16, 1024)
            except ValueError as e:
                print(f"rank {comm.rank}: {e}", flush=True)
                return 3
            return 0
    if "--fail" in argv:
        train(comm, "none", 16, 1024, fail_at=2)
        return 0
    for name, spec, _, batch, bucket_bytes in CASES:
        res = train(comm, spec, batch, bucket_bytes)
        if comm.rank == 0:
            np.savez(out / f"{name}.npz", **res)
    for name, spec, precision, batch, bucket_bytes in MIXED_CASES:
        res = train(comm, spec, batch, bucket_bytes, precision=precision)
        if comm.rank == 0:
            np.savez(out / f"{name}.npz", **res)
    for name, spec, precision in OFFLOAD_CASES:
        res = train(comm, spec, 15, 1024, precision=precision, optimizer="adam",
                    loss_scale=OFFLOAD_FP16_SCALE if precision == "fp16-mixed" else None)
        if comm.rank == 0:
            np.savez(out / f"{name}.npz", **res)
    for name, spec, precision in RESUME_CASES:
        res = train(comm, spec, 15, 1024, precision=precision, optimizer="adam",
                    resume=out / f"{name}.ckpt.npz")
        if comm.rank == 0:
            np.savez(out / f"{name}.npz", **res)
    for name, sync_bn, spec in BN_CASES:
        res = train(comm, spec, 16, 1024, bn=True, sync_bn=sync_bn)
        if comm.rank == 0:
            np.savez(out / f"{name}.npz", **res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
