"""Memory recording of real runs: a dry run (meta device) and a real run of the same spec give
the same peak and the same events in the same order; the trace follows the Chrome trace event
format; snapshots, plots and ``minidl show-memory`` through the API and the CLI."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest

import minidl
from minidl.analysis.memory_record import (
    load_snapshot,
    show_memory,
    snapshot_series,
    snapshot_trace,
)
from minidl.cli import main
from minidl.zoo.models import smallcnn

SPEC = "reuse,inplace,swap=conv,recompute=sqrt,binarize"


def _recorded(device: str, spec: str = SPEC) -> dict:
    net = smallcnn((1, 16, 16), 10, width=8)
    tr = minidl.Trainer(net, memory=spec, device=device, device_memory="64MiB")
    x = np.random.default_rng(0).normal(size=(16, 1, 16, 16)).astype(np.float32)
    y = np.arange(16) % 10
    tr.step(x, y)  # plans refined after the first measured iteration
    with tr.record_memory() as rec:
        tr.step(x, y)
        tr.step(x, y)
    assert rec.iterations == 2
    return rec.snapshot()


@pytest.fixture(scope="module")
def real() -> dict:
    return _recorded("cpu")


@pytest.mark.parametrize("spec", [SPEC, "none"])
def test_dry_run_and_real_run_record_the_same_peak_and_events(spec, real):
    real = real if spec == SPEC else _recorded("cpu", spec)
    dry = _recorded("meta", spec)
    assert real["timed"] and not dry["timed"]
    assert real["peak"]["bytes"] == dry["peak"]["bytes"]
    assert (real["peak"]["step"], real["peak"]["live"]) == (dry["peak"]["step"],
                                                           dry["peak"]["live"])
    assert [e[1:] for e in real["events"]] == [e[1:] for e in dry["events"]]
    assert [a[2:] for a in real["actions"]] == [a[2:] for a in dry["actions"]]
    report = minidl.dry_run(smallcnn((1, 16, 16), 10, width=8), 16, spec,
                            input_shape=(1, 16, 16))
    assert real["peak"]["bytes"] == report["peak_allocated_bytes"]
    totals = [sum(v[i] for v in snapshot_series(real)["bytes"].values())
              for i in range(len(real["events"]))]
    assert max(totals) == real["peak"]["bytes"]


def test_every_kind_of_event_is_recorded_with_owner_and_time(real):
    ops = {e[2] for e in real["events"]}
    assert ops == {"alloc", "free", "prefetch", "release"}
    assert {a[3] for a in real["actions"]} >= {"alloc", "free", "offload", "release",
                                                "prefetch", "await"}
    assert {s["phase"] for s in real["steps"]} >= {"forward", "backward", "recompute", "encode"}
    times = [e[0] for e in real["events"]]
    assert all(a <= b for a, b in zip(times, times[1:])) and times[0] >= 0
    owners = {e[5]: e[6] for e in real["events"]}
    assert owners["pool1"] == "pool1" and owners["conv2.bwd_ws"] == "conv2"
    spans = [(s["start_s"], s["end_s"]) for s in real["steps"]]
    assert all(s <= e <= s2 + 1e-9 for (s, e), (s2, _) in zip(spans, spans[1:]))
    assert {c["direction"] for c in real["copies"]} == {"d2h", "h2d"}


def _check_chrome_trace(doc: dict) -> None:
    """The Chrome trace event format's rules this trace relies on."""
    assert set(doc) >= {"traceEvents"}
    tracks: dict[tuple, list[float]] = defaultdict(list)
    for ev in doc["traceEvents"]:
        assert ev["ph"] in {"X", "i", "C", "M"} and isinstance(ev["pid"], int)
        if ev["ph"] == "M":
            assert ev["name"] in {"process_name", "thread_name", "thread_sort_index"}
            continue
        assert isinstance(ev["ts"], float | int) and ev["ts"] >= 0
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and isinstance(ev["tid"], int)
        if ev["ph"] == "C":
            assert all(isinstance(v, int) for v in ev["args"].values())
            tracks[("C", ev["name"])].append(ev["ts"])
        else:
            tracks[(ev["ph"], ev["tid"])].append(ev["ts"])
    for key, ts in tracks.items():
        assert all(a <= b for a, b in zip(ts, ts[1:])), key


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_trace_is_a_chrome_trace_with_named_tracks(device, real):
    snap = real if device == "cpu" else _recorded("meta")
    doc = snapshot_trace(snap)
    json.dumps(doc)
    _check_chrome_trace(doc)
    ev = doc["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert names == {"compute", "memory events", "copy device to host", "copy host to device"}
    compute = [e for e in ev if e["ph"] == "X" and e["tid"] == 1]
    assert [(e["name"], e["cat"]) for e in compute] == [(s["layer"], s["phase"])
                                                       for s in snap["steps"]]
    counters = [e for e in ev if e["ph"] == "C"]
    assert max(sum(e["args"].values()) for e in counters) == snap["peak"]["bytes"]
    assert set(counters[0]["args"]) >= {"parameter", "feature_map"}
    copies = [e for e in ev if e["ph"] == "X" and e["tid"] in (3, 4)]
    assert len(copies) == len(snap["copies"]) and (device == "meta" or copies)


def test_show_memory_text(real):
    text = show_memory(real, top=3)
    assert f"{real['peak']['bytes']:,} B" in text
    top = real["peak"]["live"][0]
    assert any(top["tensor"] in ln and top["layer"] in ln for ln in text.splitlines())
    assert "largest tensors live at the peak (3 of" in text
    marked = [ln for ln in text.splitlines() if " *#" in ln]
    assert len(marked) == 1 and real["peak"]["layer"] in marked[0]


def test_cli_train_records_and_show_memory_reads(tmp_path, capsys):
    import importlib.util

    snap, tr, png = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "p.png"
    plot = importlib.util.find_spec("matplotlib") is not None  # the 'plot' extra
    code = main(["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8",
                 "--max-steps", "3", "--memory", "reuse,swap=conv", "--no-progress",
                 "--snapshot", str(snap), "--trace", str(tr)]
                + (["--plot", str(png)] if plot else []))
    out = capsys.readouterr().out
    assert code == 0 and f"minidl show-memory {snap}" in out
    data = load_snapshot(snap)
    assert data["iterations_recorded"] == 3 and data["memory"] == "reuse,swap=conv"
    _check_chrome_trace(json.loads(tr.read_text()))
    assert not plot or png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show-memory", str(snap), "--top", "2", "--trace", str(tmp_path / "u.json")]) == 0
    out = capsys.readouterr().out
    assert "largest tensors live at the peak (2 of" in out and "timeline" in out
    assert json.loads((tmp_path / "u.json").read_text()) == json.loads(tr.read_text())
    assert main(["show-memory", str(tr)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a Chrome trace, not a minidl memory snapshot" in err
    assert main(["show-memory", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("times_peak, drawn", [(1.5, True), (100, False)])
def test_plot_draws_the_device_line_only_near_the_peak(real, monkeypatch, times_peak, drawn):
    """A device far larger than the peak (the Python API's default: the host's memory) would
    flatten the timeline: its line is left out and the title says so."""
    from minidl.analysis import memory_record

    seen = {}
    monkeypatch.setattr(memory_record, "plot_timeline",
                        lambda series, path, title, budget, budget_label: seen.update(
                            budget=budget, title=title))
    capacity = int(times_peak * real["peak"]["bytes"])
    snap = {**real, "budget_bytes": None, "capacity_bytes": capacity}
    memory_record.plot_snapshot(snap, "unused.png")
    assert (seen["budget"] == capacity) is drawn
    assert ("off the chart" in seen["title"]) is not drawn


def test_block_addresses_are_the_offsets_the_runtime_logged():
    net = smallcnn((1, 16, 16), 10, width=8)
    tr = minidl.Trainer(net, memory="reuse,inplace,swap=all", device="cpu",
                        device_memory="64MiB")
    x = np.random.default_rng(0).normal(size=(16, 1, 16, 16)).astype(np.float32)
    y = np.arange(16) % 10
    with tr.record_memory() as rec:
        tr.step(x, y)
    rt = rec._best.recording
    assert len(rt.event_offsets) == len(rt.events) > 0
    snap = rec.snapshot()
    assert [e[7] for e in snap["events"]] == rt.event_offsets
    live: dict[str, tuple[int, int]] = {}
    for e in snap["events"]:  # a block is given back where it was placed; none overlap
        name, delta, addr = e[5], e[4], e[7]
        if delta > 0:
            assert all(addr + delta <= a or b + a <= addr for a, b in live.values())
            live[name] = (addr, delta)
        else:
            assert live.pop(name) == (addr, -delta)
    assert snap["arena"]["reserved_bytes"] >= max(a + b for a, b in
                                                  [(e[7], e[4]) for e in snap["events"]])
    del rt.event_offsets[-1]  # a recording that lost an offset is refused, not misread
    rec._snap = None
    with pytest.raises(RuntimeError, match="offsets logged"):
        rec.snapshot()
