"""offload=optimizer with zero=1 / zero=2 without MPI: the spec's refusals, one rank's bits and
plan, what each of N hosts keeps, and what the device keeps in the dry run (the 2-rank runs
are dp_worker's OFFLOAD_CASES)."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.analysis.dryrun import dry_run
from minidl.distributed.comm import SingleProcess
from minidl.distributed.zero import ZeroOptimizer
from minidl.distributed.zero_offload import ZeroOffloadOptimizer
from minidl.memory.ir.config import MemoryConfig
from minidl.net.optim import Adam
from minidl.zoo import models
from minidl.zoo.transformers import TransformerConfig, gpt


@pytest.mark.parametrize("spec,said", [
    ("offload=optimizer,zero=3", "offload cannot be combined with zero=3 yet"),
    ("offload=parameters,zero=1", "offload=parameters cannot be combined with zero=K yet")])
def test_the_combinations_left_are_refused_in_one_line(spec, said):
    with pytest.raises(ValueError, match=said) as e:
        MemoryConfig.parse(f"reuse,{spec}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_gives_offloads_bits_and_its_plan(stage, dp_worker):
    """One rank owns every range: the bits of offload=optimizer alone, the same host bytes
    (stage 2: every gradient shard is the whole gradient), rank 0's peak and host bytes the
    plan's."""
    whole = dp_worker.train(SingleProcess(), "reuse,inplace,offload=optimizer", 15, 1024,
                            optimizer="adam")
    zero = dp_worker.train(SingleProcess(), f"reuse,inplace,offload=optimizer,zero={stage}",
                           15, 1024, optimizer="adam")
    for k in whole:
        if k.startswith(("param/", "optim/")) or k in ("losses", "host_by_kind"):
            assert np.array_equal(whole[k], zero[k]), k
    assert int(zero["peak_allocated"]) == int(zero["planned_peak"])
    assert int(zero["host_by_kind"].sum()) == int(zero["planned_host"])


def test_each_host_keeps_its_share_in_the_plan():
    """A small GPT on 8 ranks under zero=2: the plan's host bytes are an eighth of one rank's
    unsharded state (within a block per tensor), the device's persistent bytes those of
    offload alone, its peak no higher (the gradients are not copied: reduce-scattered from
    the buckets); zero=1 keeps every gradient's landing buffer and offload's peak."""
    cfg = TransformerConfig(layers=2, heads=2, dim=64, context=16, vocab=64, dropout=0.0)

    def plan(spec: str) -> dict:
        return dry_run(gpt(cfg, name="g"), 8, spec, "adam", ranks=8)

    base = plan("reuse,inplace,offload=optimizer")
    one = plan("reuse,inplace,offload=optimizer,zero=1")
    two = plan("reuse,inplace,offload=optimizer,zero=2")
    full, kinds = base["host_state"], two["host_state"]
    slack = 2 * 512 * len(gpt(cfg, name="g").parameters())  # (Adam's 2 slots, 512 B units)
    for k in ("master", "gradient", "optimizer_state"):
        assert abs(kinds[k] - full[k] / 8) <= slack < full[k] / 4, k
    assert two["host_state_bytes"] == sum(kinds.values())
    assert one["host_state"]["gradient"] == full["gradient"]
    assert one["host_state"]["master"] == kinds["master"]
    assert one["peak_allocated_bytes"] == base["peak_allocated_bytes"]
    assert two["peak_allocated_bytes"] <= base["peak_allocated_bytes"]
    assert two["zero"]["persistent_bytes"] == base["zero"]["persistent_bytes"]
    assert [c["name"] for c in two["zero"]["collectives"]] == [
        "reduce-scatter gradients", "all-gather parameters"]


def test_zero_offload_refuses_stage_3_and_other_ranges():
    net = models.smallcnn((1, 8, 8), 10, width=4)

    class Host:
        owned = None

    with pytest.raises(ValueError, match="under zero=1 or zero=2, got zero=3"):
        ZeroOffloadOptimizer(ZeroOptimizer(Adam(net.parameters(), lr=0.01), SingleProcess(),
                                           3), Host())
    with pytest.raises(ValueError, match="other ranges than the optimizer's shards"):
        ZeroOffloadOptimizer(ZeroOptimizer(Adam(net.parameters(), lr=0.01), SingleProcess(),
                                           2), Host())
