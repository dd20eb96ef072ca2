"""Unit tests of the program rewrites on hand-built programs: ``recompute`` (checkpoints,
clones, slots) and ``compress`` (encode / decode steps, consumers)."""

from __future__ import annotations

import pytest
from hand_programs import MAX_POOL_2X2, chain, ids, linear_chain, residual

from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.payloads import CodecStep, EncodedInput, RecomputeSummary
from minidl.memory.passes.base_plan import iteration_peak
from minidl.memory.passes.compress import compress_program
from minidl.memory.passes.recompute import (
    articulation_values,
    choose_checkpoints,
    policy_program,
    recompute_program,
)


def names(program, tids) -> list[str]:
    return [program.tensors[t].name for t in tids]


def outline(program) -> list[tuple[str, list[str], list[str]]]:
    return [(st.label, names(program, st.access.reads), names(program, st.access.writes))
            for st in program.steps]


# ---- recompute


def test_articulation_values():
    p = chain()
    assert names(p, articulation_values(p)) == ["conv", "relu", "pool", "fc", "loss"]
    # relu1 is read by conv2 and by add: conv2 is no cut point
    r = residual()
    assert names(r, articulation_values(r)) == ["conv1", "relu1", "add", "relu2", "fc", "loss"]


@pytest.mark.parametrize("n, kept", [
    (3, ["l1", "loss"]),  # 4 candidates: every 2nd
    (8, ["l2", "l5", "loss"]),  # 9 candidates: every 3rd
    (15, ["l3", "l7", "l11", "loss"]),  # 16: every 4th
    (16, ["l4", "l9", "l14"]),  # 17: every ceil(sqrt(17)) = 5th
])
def test_sqrt_keeps_every_ceil_sqrt_m_th_articulation_point(n, kept):
    p = linear_chain(n)
    assert sorted(names(p, choose_checkpoints(p, "sqrt"))) == sorted(kept)


@pytest.mark.parametrize("policy", ["speed", "memory", "cost"])
def test_speed_memory_cost_keep_expensive_and_fork_outputs(policy):
    p = chain()
    assert sorted(names(p, choose_checkpoints(p, policy))) == ["conv", "fc"]
    r = residual()  # relu1 is read twice (a fork)
    assert sorted(names(r, choose_checkpoints(r, policy))) == [
        "add", "conv1", "conv2", "fc", "relu1"]


def test_speed_recomputes_a_segment_once_and_backward_reads_the_clones():
    q = policy_program(chain(), "speed")
    assert outline(q)[5:] == [
        ("loss (backward)", ["loss.grad", "fc", "labels"], ["fc.grad"]),
        ("relu (recompute)", ["conv"], ["relu@r1"]),
        ("pool (recompute)", ["relu@r1"], ["pool@r1", "pool.argmax@r1"]),
        ("fc (backward)", ["fc.grad", "pool@r1", "fc.w"], ["pool.grad", "fc.w.grad"]),
        ("pool (backward)", ["pool.grad", "pool.argmax@r1"], ["relu.grad"]),
        ("relu (backward)", ["relu.grad", "relu@r1"], ["conv.grad"]),
        ("conv (backward)", ["conv.grad", "x", "conv.w"], ["conv.w.grad"]),
    ]
    t = ids(q)
    relu_rc, pool_rc, fc_b, pool_b, relu_b = q.steps[6:11]
    assert (relu_rc.cost.origin, pool_rc.cost.origin) == (1, 2)  # the forward steps they rerun
    # every slot names the clones, not only memory's reads
    assert pool_rc.forward.inputs == (t["relu@r1"],) and pool_rc.forward.outputs == (t["pool@r1"],)
    assert pool_rc.forward.stash == {"argmax": t["pool.argmax@r1"]}
    assert fc_b.forward.inputs == (t["pool@r1"],)
    assert pool_b.forward.inputs == (t["relu@r1"],) and pool_b.forward.outputs == (t["pool@r1"],)
    assert pool_b.forward.stash == {"argmax": t["pool.argmax@r1"]}
    assert relu_b.forward.outputs == (t["relu@r1"],) and relu_b.forward.inputs == (t["conv"],)
    assert relu_rc.access.shares == ((t["relu@r1"], t["conv"]),)
    for clone in ("relu@r1", "pool@r1", "pool.argmax@r1"):
        spec = q.tensors[t[clone]]
        assert spec.of == t[clone.split("@")[0]]
        assert spec.nbytes == q.tensors[spec.of].nbytes
    assert q.rewrites.recompute == RecomputeSummary(recomputed_flops=100 + 200,
                                                    recomputed_steps=2, dropped_layers=2,
                                                    checkpoints=2)


def test_memory_policy_recomputes_per_backward_step():
    q = policy_program(chain(), "memory")
    labels = [label for label, _, _ in outline(q)[5:]]
    assert labels == [
        "loss (backward)",
        "relu (recompute)", "pool (recompute)", "fc (backward)",
        "relu (recompute)", "pool (recompute)", "pool (backward)",
        "relu (recompute)", "relu (backward)",
        "conv (backward)"]
    # each backward step reads its own group's clones
    pool_b, relu_b = q.steps[11], q.steps[13]
    assert names(q, pool_b.access.reads) == ["pool.grad", "pool.argmax@r-8"]
    assert names(q, relu_b.access.reads) == ["relu.grad", "relu@r-9"]
    assert q.rewrites.recompute.recomputed_steps == 5


def test_recompute_originals_die_in_forward():
    for policy in ("speed", "memory"):
        q = policy_program(chain(), policy)
        t = ids(q)
        last = max(st.index for st in q.steps if t["relu"] in st.access.reads + st.access.writes)
        assert q.steps[last].label == "pool (forward)"


def test_recompute_peaks():
    cfg = MemoryConfig.parse("reuse")
    # on the chain, the dropped ReLU is as large as the conv it is recomputed from: recomputing
    # costs memory (units: reuse 16, speed 17; memory-centric recomputes relu and pool again
    # for pool's backward while conv is still kept: 18)
    p = chain()
    assert [iteration_peak(q, cfg) // 512 for q in (
        p, policy_program(p, "speed"), policy_program(p, "memory"))] == [16, 17, 18]
    # on 8 linear layers of 2 units, sqrt keeps 3 of 9 and drops the rest: 24 -> 16 units
    lc = linear_chain(8)
    assert iteration_peak(lc, cfg) == 24 * 512
    assert iteration_peak(policy_program(lc, "sqrt"), cfg) == 16 * 512
    assert policy_program(lc, "sqrt").rewrites.recompute.dropped_layers == 6


def test_recompute_program_with_no_drop_is_the_same_program():
    p = chain()
    everything = {t for st in p.steps if st.phase == "forward" for t in st.access.writes
                  if p.tensors[t].role == "value"}
    q = recompute_program(p, everything, {})
    assert outline(q) == outline(p)
    assert q.rewrites.recompute.recomputed_steps == 0


def test_cost_needs_a_peak_estimator_and_unknown_policy_is_an_error():
    with pytest.raises(ValueError, match="needs a peak estimator"):
        policy_program(chain(), "cost")
    with pytest.raises(ValueError, match="unknown recompute policy 'fast'"):
        policy_program(chain(), "fast")


def test_cost_policy_takes_speed_segments_that_do_not_raise_the_memory_peak():
    p = chain()
    cfg = MemoryConfig.parse("reuse")
    q = policy_program(p, "cost", peak_of=lambda prog: iteration_peak(prog, cfg))
    # the one cheap segment (relu, pool, fc) recomputed once lowers the peak (17 < 18): taken
    speed = policy_program(p, "speed")
    assert [label for label, _, _ in outline(q)] == [label for label, _, _ in outline(speed)]
    assert iteration_peak(q, cfg) == iteration_peak(speed, cfg) == 17 * 512
    assert q.rewrites.recompute.recomputed_steps == 2


# ---- compress


def test_binarize_encodes_relu_sign_and_packed_argmax_consumed_by_backward():
    p = chain()
    q = compress_program(p, binarize=True)
    t = ids(q)
    assert outline(q) == [
        ("conv (forward)", ["x", "conv.w"], ["conv"]),
        ("relu (forward)", ["conv"], ["relu"]),
        ("pool (forward)", ["relu"], ["pool", "pool.argmax"]),
        ("relu (encode)", ["relu"], ["relu.sign"]),
        ("pool (encode)", ["pool.argmax"], ["pool.argmax.poolidx"]),
        ("fc (forward)", ["pool", "fc.w"], ["fc"]),
        ("loss (forward)", ["fc", "labels"], ["loss"]),
        ("loss (backward)", ["loss.grad", "fc", "labels"], ["fc.grad"]),
        ("fc (backward)", ["fc.grad", "pool", "fc.w"], ["pool.grad", "fc.w.grad"]),
        ("pool (backward)", ["pool.grad", "pool.argmax.poolidx"], ["relu.grad"]),
        ("relu (backward)", ["relu.grad", "relu.sign"], ["conv.grad"]),
        ("conv (backward)", ["conv.grad", "x", "conv.w"], ["conv.w.grad"]),
    ]
    # 512 floats: 1 bit each; 256 argmax indices of a 2x2 window: 2 bits each
    assert q.tensors[t["relu.sign"]].nbytes == 64
    assert q.tensors[t["pool.argmax.poolidx"]].nbytes == 64
    assert q.steps[9].op.from_encoded == EncodedInput("packed_argmax", t["pool.argmax.poolidx"])
    assert q.steps[10].op.from_encoded == EncodedInput("sign", t["relu.sign"])
    assert q.steps[3].op.codec == CodecStep("sign", t["relu"])
    assert q.steps[4].op.codec == CodecStep("poolidx", t["pool.argmax"], MAX_POOL_2X2.pool)
    assert q.rewrites.compression.encoded == {"relu": "sign", "pool.argmax": "poolidx"}
    assert p.steps[9].op.from_encoded is None  # the input program is untouched


def test_sparse_encodes_a_relu_kept_by_a_conv_and_decodes_before_its_backward():
    r = residual()
    q = compress_program(r, use_sparse=True, densities={"relu1": 0.25})
    t = ids(q)
    rows = outline(q)
    assert rows[4] == ("relu1 (encode)", ["relu1"], ["relu1.sparse"])
    assert rows[3][0] == "add (forward)"  # right after relu1's last forward use
    assert rows[12] == ("relu1 (decode)", ["relu1.sparse"], ["relu1@decoded"])
    assert rows[13][0] == "conv2 (backward)" and "relu1@decoded" in rows[13][1]
    assert rows[14] == ("relu1 (backward)", ["relu1.grad", "relu1@decoded"], ["conv1.grad"])
    assert q.steps[13].forward.inputs == (t["relu1@decoded"],)  # the slot, too
    assert q.rewrites.compression.sparse_densities == {"relu1": 0.25}
    assert q.tensors[t["relu1.sparse"]].nbytes < q.tensors[t["relu1"]].nbytes
    # not relu2: only fc reads it
    assert "relu2.sparse" not in t


def test_binarize_leaves_a_relu_another_layer_reads():
    # relu1 is read by conv2's backward, relu2 by fc's: no sign mask, nothing to rewrite
    r = residual()
    assert compress_program(r, binarize=True) is r
    # in the chain only relu's own backward reads relu
    assert compress_program(chain(), binarize=True).rewrites.compression.encoded["relu"] == \
        "sign"


def test_dpr_encodes_every_other_kept_feature_map_and_decodes_it():
    q = compress_program(chain(), binarize=True, dpr="fp16")
    assert q.rewrites.compression.encoded == {"relu": "sign", "pool.argmax": "poolidx",
                                              "pool": "fp16", "fc": "fp16"}
    rows = outline(q)
    assert ("pool (encode)", ["pool"], ["pool.fp16"]) in rows
    i = rows.index(("pool (decode)", ["pool.fp16"], ["pool@decoded"]))
    assert rows[i + 1] == ("fc (backward)", ["fc.grad", "pool@decoded", "fc.w"],
                           ["pool.grad", "fc.w.grad"])
    assert q.tensors[ids(q)["pool.fp16"]].nbytes == 512  # half of 1024


def test_compress_after_recompute_decodes_for_recomputed_readers():
    q = compress_program(policy_program(chain(), "speed"), dpr="fp16")
    rows = outline(q)
    # conv is a checkpoint read by relu's recomputation: encoded in forward, decoded before
    i = rows.index(("conv (decode)", ["conv.fp16"], ["conv@decoded"]))
    assert rows[i + 1] == ("relu (recompute)", ["conv@decoded"], ["relu@r1"])
