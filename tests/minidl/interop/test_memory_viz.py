"""PyTorch's memory snapshot format (minidl.interop.memory_viz): the pickle
torch.cuda.memory._dump_snapshot writes, written from a real run and from a dry run. The block
addresses are the pool's own; the file keeps what torch's readers and its web viewer rely on;
torch's own reader (when torch is installed: the test-time oracle) lists minidl's events; a dry
run writes the same file as a real run; train --snapshot FILE.pickle and show-memory."""

from __future__ import annotations

import base64
import json
import os
import pickle
import pickletools
import re
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl.analysis.memory_record import load_snapshot, plan_snapshot, save_snapshot, show_memory
from minidl.cli import main
from minidl.compile.engine import Engine
from minidl.interop.memory_viz import EMBED_KEY, PICKLE_PROTOCOL, torch_snapshot
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import make_optimizer
from minidl.zoo.models import smallcnn

SPEC = "reuse,inplace,swap=conv,recompute=sqrt,binarize"
BATCH = 16

#: The opcodes the web viewer's unpickler (MemoryViz.js) reads; any other one stops it.
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "DICT", "LIST",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "SETITEM", "SETITEMS", "APPEND", "APPENDS",
    "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "BININT", "BININT1", "BININT2",
    "LONG1", "SHORT_BINUNICODE", "BINUNICODE", "NEWTRUE", "NEWFALSE", "NONE", "BINFLOAT"}


def _batch():
    x = np.random.default_rng(0).normal(size=(BATCH, 1, 16, 16)).astype(np.float32)
    return x, np.arange(BATCH) % 10


def _recorded(device: str, spec: str = SPEC, memory: str = "64MiB"):
    """A recorded iteration's snapshot, and on a real device the pool's own (op, tag, offset)
    of every block allocated and freed in it."""
    net = smallcnn((1, 16, 16), 10, width=8)
    tr = minidl.Trainer(net, memory=spec, device=device, device_memory=memory)
    x, y = _batch()
    tr.step(x, y)  # plans refined after the first measured iteration
    seen: list[tuple[str, str, int]] = []
    allocate, free = tr.pool.allocate, tr.pool.free

    def hooked_allocate(*args, **kw):
        blk = allocate(*args, **kw)
        seen.append(("alloc", blk.tag, blk.offset))
        return blk

    def hooked_free(blk):
        seen.append(("free", blk.tag, blk.offset))
        free(blk)

    tr.pool.allocate, tr.pool.free = hooked_allocate, hooked_free
    with tr.record_memory() as rec:
        tr.step(x, y)
    del tr.pool.allocate, tr.pool.free
    return rec.snapshot(), seen


@pytest.fixture(scope="module")
def real():
    return _recorded("cpu")


def _events(snap: dict) -> list[tuple[str, str, int]]:
    return [("alloc" if e[2] in ("alloc", "prefetch") else "free", e[5], e[7])
            for e in snap["events"]]


def _plain(data: dict) -> dict:
    """torch's part of the file, without times (the same for a dry run and a real run)."""
    out = {k: v for k, v in data.items() if k != EMBED_KEY}
    out["device_traces"] = [[{k: v for k, v in e.items() if k != "time_us"} for e in t]
                            for t in data["device_traces"]]
    return out


@pytest.mark.parametrize("spec, memory", [
    (SPEC, "64MiB"),
    ("vdnn", "64MiB"),  # static: blocks at the plan's offsets
    ("reuse,swap=all,cache", "tight"),  # cached blocks evicted to make room
])
def test_addresses_are_the_pools_own(spec, memory, real):
    if memory == "tight":  # the plan's own need and a little: the cache must give blocks back
        memory = str(minidl.dry_run(smallcnn((1, 16, 16), 10, width=8), BATCH, "reuse,swap=all",
                                    input_shape=(1, 16, 16))["peak_reserved_bytes"] + (16 << 10))
    snap, seen = real if spec == SPEC else _recorded("cpu", spec, memory)
    assert _events(snap) == seen
    ops = {e[2] for e in snap["events"]}
    assert spec != SPEC or ops == {"alloc", "free", "prefetch", "release"}
    assert "release" in ops or spec != "reuse,swap=all,cache"
    ends = [e[7] + abs(e[4]) for e in snap["events"]]
    ends += [b[0] + b[1] for b in snap["arena"]["blocks"]]
    assert snap["arena"]["reserved_bytes"] == max(ends)


def test_the_file_is_torchs_snapshot_format(real, tmp_path):
    """The keys torch's readers read, the blocks covering the segment, each event's block
    replayed inside it without overlap (as the web viewer replays them: its highest point is
    minidl's peak), and only opcodes the web viewer's unpickler reads."""
    snap, _ = real
    path = tmp_path / "run.pickle"
    save_snapshot(snap, path)
    raw = path.read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(raw)}
    assert raw[1] == PICKLE_PROTOCOL and ops <= VIEWER_OPCODES, ops - VIEWER_OPCODES
    data = pickle.loads(raw)
    assert set(data) == {"segments", "device_traces", EMBED_KEY} and data[EMBED_KEY] == snap
    (seg,) = data["segments"]
    assert {"device", "address", "total_size", "stream", "segment_type", "allocated_size",
            "active_size", "requested_size", "blocks"} <= set(seg)
    assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
    assert seg["total_size"] == snap["arena"]["reserved_bytes"]
    addr = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
        assert isinstance(b["frames"], list) and b["requested_size"] <= b["size"]
        addr += b["size"]
    live = {b["address"]: b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    assert sum(live.values()) == seg["allocated_size"]
    assert {b[3] for b in snap["arena"]["blocks"]} == {
        b["frames"][0]["name"] for b in seg["blocks"] if b["state"] == "active_allocated"}
    start = dict(live)
    highest = sum(live.values())
    (trace,) = data["device_traces"]
    assert len(trace) == sum(1 if e[2] in ("alloc", "prefetch") else 2 for e in snap["events"])
    i = 0
    while i < len(trace):
        e = trace[i]
        assert {"action", "addr", "size", "stream", "frames", "time_us"} <= set(e)
        assert all(set(f) == {"filename", "line", "name"} for f in e["frames"])
        if e["action"] == "alloc":
            lo, hi = e["addr"], e["addr"] + e["size"]
            assert seg["address"] <= lo and hi <= seg["address"] + seg["total_size"]
            assert all(hi <= a or a + n <= lo for a, n in live.items())
            live[lo] = e["size"]
            highest = max(highest, sum(live.values()))
            i += 1
        else:  # a free: requested then completed, of a live block
            done = trace[i + 1]
            assert (e["action"], done["action"]) == ("free_requested", "free_completed")
            assert (done["addr"], done["size"]) == (e["addr"], e["size"])
            assert live.pop(e["addr"]) == e["size"]
            i += 2
    assert live == start  # the iteration frees what it allocates
    assert highest == snap["peak"]["bytes"]  # the viewer's highest point is minidl's peak


def test_frames_name_the_tensor_its_layer_category_and_step(real):
    snap, _ = real
    data = torch_snapshot(snap)
    steps = snap["steps"]
    said = {"alloc": "alloc", "free": "free", "prefetch": "prefetch (copy back from host)",
            "release": "release (offloaded to host)"}
    entries = [t for t in data["device_traces"][0] if t["action"] != "free_completed"]
    assert len(entries) == len(snap["events"])
    for e, t in zip(snap["events"], entries):
        step = e[1]
        where = ("before the first step" if step < 0 else "after the last step"
                 if step >= len(steps) else f"{steps[step]['layer']} {steps[step]['phase']}")
        assert t["frames"] == [
            {"filename": "tensor", "line": step, "name": e[5]},
            {"filename": "layer", "line": step, "name": e[6] or "-"},
            {"filename": "category", "line": step, "name": e[3]},
            {"filename": "step", "line": step, "name": f"{said[e[2]]} at {where}"}]
    assert {"conv1", "conv2.bwd_ws"} <= {t["frames"][0]["name"] for t in entries}


def test_dry_run_and_real_run_write_the_same_file(real, tmp_path):
    """The meta device records the same events: a Trainer on it and the dry run of minidl plan
    (plan_snapshot) write what the real run writes, less its times."""
    snap, _ = real
    meta, _ = _recorded("meta")
    net = smallcnn((1, 16, 16), 10, width=8)
    pool = Pool(MetaDevice())
    engine = Engine(net, pool, MemoryConfig.parse(SPEC), SoftmaxCrossEntropy(),
                    make_optimizer("sgd", net.parameters()), bind=False)
    c = engine.compiled([(BATCH, 1, 16, 16)], (BATCH,), training=True)
    c.executor.run([None, None], training=True, record=True)
    path = tmp_path / "plan.pickle"
    planned = plan_snapshot(c, engine.peak_info(c), path, model=net.name, memory=SPEC)
    dry = pickle.loads(path.read_bytes())
    assert dry[EMBED_KEY] == planned and not planned["timed"]
    assert _plain(torch_snapshot(snap)) == _plain(torch_snapshot(meta)) == _plain(dry)
    assert all("time_us" not in e for e in dry["device_traces"][0])
    times = [e["time_us"] for e in torch_snapshot(snap)["device_traces"][0]]
    assert times == sorted(times) and times[0] >= 0
    plan_snapshot(c, engine.peak_info(c), tmp_path / "plan.json", model=net.name, memory=SPEC)
    assert json.loads((tmp_path / "plan.json").read_text())["events"] == planned["events"]


def _torch_viz():
    return pytest.importorskip("torch.cuda._memory_viz")


def test_torch_trace_lists_minidls_events(real):
    m = _torch_viz()
    snap, _ = real
    data = torch_snapshot(snap)
    text = m.trace(data)
    allocs = re.findall(r"^(\w+) = (?:MEM|seg_\d+)\[(\d+):(\S+)\]$", text, re.M)
    dels = re.findall(r"^del (\w+) # (\S+)$", text, re.M)
    done = re.findall(r"^# free completed for (\w+) (\S+)$", text, re.M)
    mine = [(e[2], e[5], e[7], abs(e[4])) for e in snap["events"]]
    grown = [(a, n) for op, _, a, n in mine if op in ("alloc", "prefetch")]
    freed = [n for op, _, _, n in mine if op in ("free", "release")]
    assert [(int(off), size) for _, off, size in allocs] == [
        (a, m._format_size(n)) for a, n in grown]
    assert [size for _, size in dels] == [size for _, size in done] == [
        m._format_size(n) for n in freed]
    assert f"{len(data['device_traces'][0])} entries" in text
    # each entry torch lists carries the tensor minidl allocated or freed there
    entries = [e for e in data["device_traces"][0] if e["action"] != "free_completed"]
    assert [e["frames"][0]["name"] for e in entries] == [tensor for _, tensor, _, _ in mine]


def test_torch_stats_and_plots_read_it(real):
    m = _torch_viz()
    snap, _ = real
    data = torch_snapshot(snap)
    stats = m.segsum(data)
    reserved = m.Bytes(data["segments"][0]["total_size"])
    assert "segments: 1" in stats and f"total_reserved: {reserved}" in stats
    for page in (m.trace_plot(data), m.trace_plot(data, plot_segments=True), m.segment_plot(data),
                 m.trace_plot(torch_snapshot(snap), filter_freed=True)):
        assert page.startswith("\n<!DOCTYPE html>") and "add_local_files" in page
        encoded = json.loads(page.split("const local_files = ")[1].split("\n")[0])[0]["base64"]
        assert pickle.loads(base64.b64decode(encoded))["segments"] == data["segments"]


def test_python_m_torch_memory_viz_opens_the_file(real, tmp_path):
    _torch_viz()
    snap, _ = real
    path = tmp_path / "run.pkl"
    save_snapshot(snap, path)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    entries = sum(1 if e[2] in ("alloc", "prefetch") else 2 for e in snap["events"])
    for action, expect in (("stats", "total_reserved"), ("trace", f"{entries} entries")):
        r = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", action, str(path)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert expect in r.stdout


def test_train_writes_torchs_format_and_show_memory_reads_it(tmp_path, capsys):
    path = tmp_path / "run.pickle"
    code = main(["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8",
                 "--max-steps", "2", "--memory", "reuse,swap=conv", "--no-progress",
                 "--snapshot", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    assert f"python -m torch.cuda._memory_viz trace {path}" in out
    assert "https://pytorch.org/memory_viz" in out and f"minidl show-memory {path}" in out
    data = pickle.loads(path.read_bytes())
    snap = load_snapshot(path)
    assert snap == data[EMBED_KEY] and snap["memory"] == "reuse,swap=conv"
    assert data["device_traces"][0] and data["segments"][0]["blocks"]
    assert main(["show-memory", str(path), "--top", "2"]) == 0
    assert capsys.readouterr().out.strip() == show_memory(snap, top=2)


def _refused(path, capsys) -> str:
    assert main(["show-memory", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    return err


def test_show_memory_says_how_to_open_pytorchs_own_snapshots(real, tmp_path, capsys):
    snap, _ = real
    theirs = {k: v for k, v in torch_snapshot(snap).items() if k != EMBED_KEY}
    path = tmp_path / "torch.pickle"
    path.write_bytes(pickle.dumps(theirs))
    err = _refused(path, capsys)
    assert "is a PyTorch memory snapshot" in err and "https://pytorch.org/memory_viz" in err
    assert f"python -m torch.cuda._memory_viz trace {path}" in err
    path.write_bytes(pickle.dumps(theirs["segments"]))
    assert "allocator segments" in _refused(path, capsys)
    path.write_bytes(pickle.dumps(7))
    assert "a pickle but not a memory snapshot" in _refused(path, capsys)
    from collections import OrderedDict  # a pickle naming a class is not run

    path.write_bytes(pickle.dumps(OrderedDict(a=1)))
    assert "not plain data" in _refused(path, capsys)
    path.write_bytes(pickle.dumps(theirs)[:50])
    assert "not a readable memory snapshot pickle" in _refused(path, capsys)


def test_a_version_1_snapshot_has_no_addresses(real):
    snap, _ = real
    old = {k: v for k, v in snap.items() if k != "arena"}
    with pytest.raises(ValueError, match="before minidl recorded block addresses"):
        torch_snapshot(old)


def test_written_without_torch(real, tmp_path):
    snap, _ = real
    src, dst = tmp_path / "run.json", tmp_path / "run.pickle"
    save_snapshot(snap, src)
    code = ("import sys; sys.modules['torch'] = None\n"
            "from minidl.analysis.memory_record import load_snapshot, save_snapshot\n"
            f"save_snapshot(load_snapshot({str(src)!r}), {str(dst)!r})\n"
            "assert sys.modules['torch'] is None")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert pickle.loads(dst.read_bytes()) == torch_snapshot(snap)
