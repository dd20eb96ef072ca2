"""Text summaries: minidl.memory_summary(trainer), and net.summary() with aligned columns
and the per-layer memory of a batch under a spec."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.analysis.summary import layer_memory, summary
from minidl.zoo.models import resnet, smallcnn


def test_memory_summary_is_a_boxed_table_of_the_pool_and_the_peak():
    net = smallcnn((1, 16, 16), 10, width=8)
    tr = minidl.Trainer(net, memory="reuse,inplace,swap=conv", device_memory="32MiB")
    x = np.zeros((16, 1, 16, 16), np.float32)
    y = np.zeros(16, np.int64)
    tr.step(x, y)
    tr.step(x, y)
    text = minidl.memory_summary(tr)
    lines = text.splitlines()
    assert len({len(ln) for ln in lines}) == 1 and all(ln[0] == ln[-1] == "|" for ln in lines)
    s = tr.pool.stats()
    peak = minidl.memory.ir.units.format_size(s["allocated_bytes.peak"])
    allocated = next(ln for ln in lines if ln.startswith("| allocated "))
    assert allocated.rstrip(" |").endswith(peak)
    rep = tr.memory_report()
    assert f"at {rep['peak_step']['layer']} (backward" in text
    assert rep["largest_live"][0]["tensor"] in text and "swap:" in text and "note: swap" in text


def test_long_layer_names_keep_the_columns_aligned():
    net = resnet(8, (3, 16, 16), 10)
    text = summary(net, 8, "reuse,inplace")
    lines = text.splitlines()[:-2]
    header = lines[0]
    for col in ("params", "output bytes", "kept for bwd", "workspace"):
        end = header.index(col) + len(col)
        for ln in lines[1:]:
            assert ln[end - 1] != " " and (end == len(ln) or ln[end] == " "), (col, ln)
    assert max(len(n.name) for n in net.nodes) > 16  # names longer than the old fixed column


@pytest.mark.parametrize("spec", ["none", "reuse,inplace", "reuse,swap=conv", "recompute=sqrt",
                                  "gist"])
def test_layer_memory_kept_for_backward_adds_up_to_the_dry_run(spec):
    rows = layer_memory(resnet(8, (3, 16, 16), 10), 8, spec)
    rep = minidl.dry_run(resnet(8, (3, 16, 16), 10), 8, spec)
    assert sum(r["kept"] for r in rows.values()) == rep["kept_for_backward_bytes"]
    outputs = {r["layer"]: r["output_bytes"] for r in rep["layers"]}
    assert {k: r["output"] for k, r in rows.items() if k in outputs} == outputs
    conv = rows["conv1"]
    assert conv["workspace"] > 0 and conv["output"] == 8 * 16 * 16 * 16 * 4


def test_summary_shows_what_a_spec_keeps():
    net = smallcnn((1, 16, 16), 10, width=8)
    kept = {spec: layer_memory(net, 64, spec) for spec in ("none", "reuse,swap=conv")}
    assert kept["none"]["conv1"]["kept"] == kept["none"]["conv1"]["output"]
    assert kept["reuse,swap=conv"]["conv1"]["kept"] == 0  # offloaded before backward
    text = summary(net, 64, "reuse,swap=conv")
    assert "batch 64, memory 'reuse,swap=conv'" in text.splitlines()[-1]
