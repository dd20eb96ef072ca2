"""ZeRO on one process: stages 1-3 bit-identical to plain training with unsharded checkpoints, the
report of what the peak holds beside the shards, stage 2's gradients and clipping over the
shards, stage 3's parameter shards, the bytes each rank allocates, and minidl plan --ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minidl.distributed.comm import SingleProcess


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_one_rank_is_bit_identical_and_checkpoints_unsharded(stage, precision,
                                                                      dp_worker):
    worker = dp_worker
    plain = worker.train(SingleProcess(), "reuse,inplace", 16, 1024, precision=precision)
    zero = worker.train(SingleProcess(), f"reuse,inplace,zero={stage}", 16, 1024,
                        precision=precision)
    assert sorted(plain) == sorted(zero)
    for k in plain:
        if k not in ("peak_allocated", "planned_peak", "table_peak", "buckets", "bucket_host"):
            assert np.array_equal(plain[k], zero[k]), k  # (optim/: the unsharded state)
    if stage == 1:  # one rank holds every shard: the same bytes
        assert int(zero["peak_allocated"]) == int(plain["peak_allocated"])
    assert int(zero["peak_allocated"]) == int(zero["planned_peak"])
    assert not np.allclose(zero["losses"][0], zero["losses"][-1])  # it trained


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_report_says_what_the_peak_holds_beside_the_shards(stage):
    """Stage 2 and 3 hold full gradients (and stage 3 gathered parameters) at the peak, which
    on few ranks can outweigh the shards' savings: the report says how much of each."""
    from minidl.train.trainer import Trainer
    from minidl.zoo import models

    tr = Trainer(models.smallcnn((1, 8, 8), 10), memory=f"reuse,inplace,zero={stage}",
                 device_memory="16MiB")
    rng = np.random.default_rng(0)
    tr.step(rng.normal(size=(8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8))
    note = [n for n in tr.memory_report()["notes"] if n.startswith(f"ZeRO stage {stage}")]
    assert len(note) == 1 and "of full gradients before their reduce-scatter" in note[0]
    assert ("gathered whole for their step" in note[0]) is (stage == 3)


def test_zero2_keeps_no_full_gradient_and_clips_over_the_shards():
    from minidl.net.optim import SGD, clip_grad_norm_
    from minidl.train.trainer import Trainer
    from minidl.zoo import models

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    runs = []
    for spec in ("reuse", "reuse,zero=2"):
        net = models.smallcnn((1, 8, 8), 10, width=2)
        trainer = Trainer(net, SGD(net.parameters(), lr=0.1), memory=spec,
                          device_memory="4MiB", clip_grad_norm=0.05)
        norms = []
        if trainer.config.zero:
            def recorded(m, clip=trainer.optimizer.clip_grad_norm, norms=norms):
                norms.append(clip(m))
                return norms[-1]

            trainer.optimizer.clip_grad_norm = recorded
        else:
            trainer.compute_gradients(x, y)
            norms.append(clip_grad_norm_(net.parameters(), 1e9))
        trainer.step(x, y)
        if trainer.config.zero:
            assert all(p.grad is None for p in net.parameters())  # the shards hold them
            assert {b.category for b in trainer.engine.persistent_blocks} >= {"gradient"}
        runs.append((norms[0], {k: np.array(v) for k, v in net.state_dict().items()}))
        trainer.close()
    assert runs[0][0] > 0.05 and runs[1][0] == runs[0][0]  # the same norm, clipped
    for k, v in runs[0][1].items():
        assert np.array_equal(runs[1][1][k], v), k
    with pytest.raises(ValueError, match="split=2 cannot be combined with zero=2: "
                                         "micro-batches accumulate full gradients"):
        Trainer(models.smallcnn((1, 8, 8), 10, width=2), memory="reuse,split=2,zero=2",
                device_memory="4MiB")


class _Alone:
    """Rank 0 of a pretend 2-rank job whose other rank agrees with everything."""

    rank, size, name = 0, 2, "pretend"

    def allgather_object(self, obj):
        return [obj, obj]

    def broadcast(self, buf, root=0):
        pass

    def duplicate(self):
        return self

    def close(self):
        pass


def test_zero3_recomputations_gather_their_own_copies(dp_worker):
    """Under zero=3 with recomputation each recomputed step reads a parameter gathered again
    for it (as DeepSpeed's stage 3 with activation checkpointing re-gathers), not the forward's
    block kept until then: bit-identical to plain training, dry == real."""
    from minidl.compile.engine import Engine
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.memory.devices.device import MetaDevice
    from minidl.memory.ir.names import Phase, Role
    from minidl.memory.runtime.pool import Pool
    from minidl.net.optim import SGD

    spec = "reuse,inplace,recompute=sqrt"
    plain = dp_worker.train(SingleProcess(), spec, 16, 1024)
    zero = dp_worker.train(SingleProcess(), f"{spec},zero=3", 16, 1024)
    for k in plain:
        if k.startswith(("param/", "optim/")) or k == "losses":
            assert np.array_equal(plain[k], zero[k]), k
    assert int(zero["peak_allocated"]) == int(zero["planned_peak"])
    net = dp_worker._net(False)
    engine = Engine(net, Pool(MetaDevice()), f"{spec},zero=3", SoftmaxCrossEntropy(),
                    SGD(net.parameters(), lr=0.1), bind=False)
    prog = engine.compiled([(16, *net.input_shapes[0])], (16,), True).plan.program
    redo = [st for st in prog.steps if st.phase == Phase.RECOMPUTE and st.forward.params]
    assert redo
    for st in redo:
        for t in st.forward.params.values():
            spec_t = prog.tensors[t]
            assert spec_t.role == Role.PARAM and not spec_t.persistent and spec_t.of >= 0
            assert not any(t in f.access.reads for f in prog.steps if f.phase == Phase.FORWARD)


def test_zero3_keeps_parameter_shards_and_needs_rows_on_every_rank():
    from minidl.train.trainer import Trainer
    from minidl.zoo import models

    net = models.smallcnn((1, 8, 8), 10, width=2)
    host = {p.name: p.data for p in net.parameters()}
    trainer = Trainer(net, memory="reuse,zero=3", device_memory="4MiB", comm=_Alone())
    assert all(p.data is host[p.name] for p in net.parameters())  # not in the pool
    shards = trainer.optimizer.shard.params
    assert sum(p.hi - p.lo for p in shards) == -(-net.num_parameters() // 2)
    for p in shards:  # the shards (in the pool) hold the parameters' owned values
        assert np.array_equal(p.data, host[p.base.name].reshape(-1)[p.lo:p.hi])
    with pytest.raises(ValueError, match=r"zero=3 \(per-step gathers\) needs rows on every "
                                         "rank: a batch of 1 samples leaves 1 of the 2 ranks"):
        trainer.step(np.zeros((1, 1, 8, 8), np.float32), np.zeros(1, np.int64))


class _Rank:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def test_zero_bytes_are_what_the_engine_allocates_for_each_rank():
    from minidl.compile.engine import Engine
    from minidl.distributed.zero import ZeroOptimizer
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.memory.devices.device import MetaDevice
    from minidl.memory.passes.zero import zero_bytes
    from minidl.memory.runtime.pool import Pool
    from minidl.net.optim import Adam
    from minidl.zoo import models

    def engine(make_opt, spec="reuse"):
        net = models.smallcnn((1, 8, 8), 10, width=3)
        return Engine(net, Pool(MetaDevice()), spec, SoftmaxCrossEntropy(),
                      make_opt(net), bind=False)

    full = engine(lambda net: Adam(net.parameters()))
    prog = full.compiled([(4, 1, 8, 8)], (4,), True).lowered.program
    for stage in (1, 2, 3):
        for ranks in (1, 2, 3):
            for rank in range(ranks):
                e = engine(lambda net, r=rank, n=ranks, s=stage: ZeroOptimizer(
                    Adam(net.parameters()), _Rank(r, n), s), f"reuse,zero={stage}")
                allocated: dict[str, int] = {}
                for blk in e.persistent_blocks:
                    allocated[blk.category] = allocated.get(blk.category, 0) + blk.size
                zb = zero_bytes(prog, stage, ranks, rank)
                assert zb.persistent == allocated, (stage, ranks, rank)
                # the program a rank runs holds what the engine allocated (static offsets
                # start above it), the full gradients as blocks of the iteration from stage 2
                mine = e.compiled([(4, 1, 8, 8)], (4,), True).lowered.program
                assert mine.persistent_bytes() == sum(allocated.values())
                assert any(t.role == "param_grad" and not t.persistent
                           for t in mine.tensors) == (stage >= 2)
                assert any(t.role == "param" and not t.persistent
                           for t in mine.tensors) == (stage == 3)  # gathered per step
                if ranks > 1:
                    assert zb.persistent["optimizer_state"] < zb.unsharded["optimizer_state"]
                    assert (zb.persistent["gradient"] < zb.unsharded["gradient"]) == \
                        (stage >= 2)
                    assert (zb.persistent["parameter"] < zb.unsharded["parameter"]) == \
                        (stage == 3)
    two = zero_bytes(prog, 3, 2)
    assert two.persistent["parameter"] < two.unsharded["parameter"]
    assert two.persistent["gradient"] < two.unsharded["gradient"]
    assert [c.name for c in two.collectives] == [
        "reduce-scatter gradients", "all-gather parameters (forward)",
        "all-gather parameters (backward)", "all-gather parameters (host copy)"]


def test_plan_ranks_gives_each_ranks_sharded_bytes(capsys):
    from minidl.cli import main

    reports = {}
    for stage in (0, 1, 2, 3):
        spec = "reuse" + (f",zero={stage}" if stage else "")
        assert main(["plan", "smallcnn", "--ranks", "4", "--batch-size", "32", "--memory", spec,
                     "--optimizer", "adam", "--json"]) == 0
        reports[stage] = json.loads(capsys.readouterr().out)
    # under none too: ZeRO's per-step copies are freed after their last use in every policy
    none_peaks = []
    for stage in (0, 1, 2, 3):
        spec = "none" + (f",zero={stage}" if stage else "")
        assert main(["plan", "smallcnn", "--ranks", "4", "--batch-size", "32", "--memory", spec,
                     "--optimizer", "adam", "--json"]) == 0
        none_peaks.append(json.loads(capsys.readouterr().out)["peak_allocated_bytes"])
    assert none_peaks[0] > none_peaks[1] > none_peaks[2] > none_peaks[3], none_peaks
    for stage, rep in reports.items():
        z = rep["zero"]
        assert (rep["ranks"], rep["batch_size"], z["stage"]) == (4, 8, stage)
        # every figure is the rank's: the breakdown sums to its peak, the persistent
        # categories are its shards, and the reserved peak is not the unsharded one
        assert sum(rep["breakdown"].values()) == rep["peak_allocated_bytes"], stage
        assert rep["peak_allocated_bytes"] <= rep["peak_reserved_bytes"] \
            < rep["peak_allocated_bytes"] + (1 << 20), stage
        assert rep["breakdown"]["optimizer_state"] == z["persistent_bytes"]["optimizer_state"]
        assert rep["persistent_bytes"] == sum(z["persistent_bytes"].values())
        assert any("one rank's figures of 4" in n for n in rep["notes"])
        for cat, from_stage in (("optimizer_state", 1), ("gradient", 2), ("parameter", 3)):
            full, mine = z["unsharded_bytes"][cat], z["persistent_bytes"][cat]
            if stage >= from_stage:  # a quarter, up to a block's rounding per owned range
                assert full / 4 <= mine < full / 4 + 16 * 512, (stage, cat)
            else:
                assert mine == full, (stage, cat)
    peaks = [reports[k]["peak_allocated_bytes"] for k in range(4)]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]
    assert main(["plan", "smallcnn", "--ranks", "0"]) == 2
    assert "--ranks 0: needs 1 to the batch size" in capsys.readouterr().err


def test_fp16_overflow_under_zero2_skips_the_step_on_the_shards(dp_worker):
    import minidl
    from minidl.net.optim import SGD

    net = dp_worker._net(False)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, *net.input_shapes[0])).astype(np.float32)
    y = rng.integers(0, 10, 16)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9),
                        memory="reuse,inplace,zero=2", device_memory="16MiB",
                        comm=SingleProcess(), precision="fp16-mixed")
    tr.step(x, y)
    tr.loss_scaler.scale = 2.0 ** 40  # the loss gradient overflows float16
    before = {n: np.array(v) for n, v in net.state_dict().items()}
    tr.step(x, y)
    assert tr.loss_scaler.skipped == 1 and tr.loss_scaler.scale == 2.0 ** 39
    for n, v in net.state_dict().items():
        assert np.array_equal(v, before[n]), n
