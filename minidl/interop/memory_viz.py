"""PyTorch's memory snapshot format for minidl's recorded iterations: the pickle
``torch.cuda.memory._dump_snapshot`` writes, which https://pytorch.org/memory_viz and
``python -m torch.cuda._memory_viz`` (``stats``, ``trace``, ``trace_plot``, ``segment_plot``,
``segments``, ``memory``) open. Plain dicts and lists pickled: torch is not needed to write it.

:func:`torch_snapshot` turns a minidl snapshot (:meth:`MemoryRecorder.snapshot
<minidl.analysis.memory_record.MemoryRecorder.snapshot>`, a real run's or a dry run's) into torch's:

* ``segments``: one segment, the device arena from offset 0 over the span the iteration used
  (minidl's reserved bytes: the highest end of any block; torch's reserved memory is the sum
  of its segments), cut into ``blocks``: the blocks live when the iteration ended
  (``active_allocated``: parameters, gradients, optimizer state, with their requested size and
  frames) and the gaps between them (``inactive``).
* ``device_traces[0]``: every block event of the iteration in order: ``alloc`` for a block
  given to a tensor (a prefetch's block for the copy back from host too), ``free_requested``
  then ``free_completed`` for a block given back (the release of an offloaded tensor's block
  too; offload and await move no block). Each has ``addr`` (the block's offset in the arena),
  ``size`` (the block's bytes), ``stream`` 0, ``time_us`` (a recorded run's, from the
  iteration's start) and ``frames``, innermost first, as ``filename:line:name``:
  ``tensor:STEP:NAME``, ``layer:STEP:LAYER`` (the layer owning it), ``category:STEP:CATEGORY``
  and ``step:STEP:OP at LAYER PHASE`` (the step being run when it happened; -1 is before the
  first step).
* ``minidl_snapshot``: the minidl snapshot itself (torch's readers ignore it), so that
  ``minidl show-memory FILE.pickle`` reads the file as it reads the JSON.

The events carry no ``category`` key: the web viewer colours allocations by it only when one
of them is ``unknown`` and fails otherwise. The pickle uses protocol 4, the newest the web
viewer reads. A dry run writes the same segments and events as a real run of the same spec.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from .checkpoint import atomic_path

#: The ``format`` of minidl's own memory snapshots (:mod:`minidl.analysis.memory_record`).
SNAPSHOT_FORMAT = "minidl-memory-snapshot"

PICKLE_SUFFIXES = (".pickle", ".pkl")
#: The web viewer's unpickler reads protocols 2 to 4 (Python 3.14 writes 5 by default).
PICKLE_PROTOCOL = 4
VIEWER_URL = "https://pytorch.org/memory_viz"
EMBED_KEY = "minidl_snapshot"

_OPS = {"alloc": "alloc", "free": "free", "prefetch": "prefetch (copy back from host)",
        "release": "release (offloaded to host)"}


def is_pickle_path(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a pickle (``.pickle`` / ``.pkl``): where torch's format goes."""
    return os.fspath(path).lower().endswith(PICKLE_SUFFIXES)


def is_pickle_file(path: str | os.PathLike) -> bool:
    """Whether the file starts as a pickle of protocol 2 or later does."""
    with open(path, "rb") as f:
        head = f.read(2)
    return len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def open_hint(path: str | os.PathLike) -> str:
    """How to open a torch snapshot file."""
    return (f"open it at {VIEWER_URL} or with python -m torch.cuda._memory_viz trace "
            f"{os.fspath(path)}")


def _where(step: int, steps: list[dict[str, Any]]) -> str:
    if step < 0:
        return "before the first step"
    if step >= len(steps):
        return "after the last step"
    return f"{steps[step]['layer']} {steps[step]['phase']}"


def _frames(tensor: str, layer: str, category: str, line: int) -> list[dict[str, Any]]:
    return [{"filename": "tensor", "line": line, "name": tensor},
            {"filename": "layer", "line": line, "name": layer or "-"},
            {"filename": "category", "line": line, "name": category}]


def torch_snapshot(snap: dict[str, Any]) -> dict[str, Any]:
    """The snapshot ``torch.cuda.memory._snapshot()`` would give for the iteration recorded in
    ``snap`` (a minidl snapshot): see the module docstring."""
    if snap.get("format") != SNAPSHOT_FORMAT:
        raise ValueError("not a minidl memory snapshot")
    if "arena" not in snap:
        raise ValueError("this snapshot was written before minidl recorded block addresses "
                         "(version 1): record the run again")
    arena = snap["arena"]
    col = {n: i for i, n in enumerate(snap["event_fields"])}
    bcol = {n: i for i, n in enumerate(arena["block_fields"])}
    steps, timed = snap["steps"], snap["timed"]
    trace: list[dict[str, Any]] = []
    for e in snap["events"]:
        step, op = e[col["step"]], e[col["op"]]
        frames = _frames(e[col["tensor"]], e[col["layer"]], e[col["category"]], step)
        frames.append({"filename": "step", "line": step,
                       "name": f"{_OPS.get(op, op)} at {_where(step, steps)}"})
        entry: dict[str, Any] = {"addr": e[col["addr"]], "size": abs(e[col["delta_bytes"]]),
                                 "stream": 0, "frames": frames}
        if timed:
            entry["time_us"] = round(1e6 * e[col["time_s"]])
        if op in ("alloc", "prefetch"):
            trace.append({"action": "alloc", **entry})
        else:
            trace.append({"action": "free_requested", **entry})
            trace.append({"action": "free_completed", **entry})
    blocks: list[dict[str, Any]] = []
    end = 0
    for b in sorted(arena["blocks"], key=lambda b: b[bcol["offset"]]):
        off, size = b[bcol["offset"]], b[bcol["bytes"]]
        if off > end:
            blocks.append({"address": end, "size": off - end, "requested_size": 0,
                           "state": "inactive", "frames": []})
        blocks.append({"address": off, "size": size, "requested_size": b[bcol["requested_bytes"]],
                       "state": "active_allocated",
                       "frames": _frames(b[bcol["tensor"]], b[bcol["layer"]],
                                         b[bcol["category"]], 0)})
        end = off + size
    total = max(int(arena["reserved_bytes"]), end)
    if total > end:
        blocks.append({"address": end, "size": total - end, "requested_size": 0,
                       "state": "inactive", "frames": []})
    active = [b for b in blocks if b["state"] == "active_allocated"]
    allocated = sum(b["size"] for b in active)
    segment = {"device": 0, "address": 0, "total_size": total, "stream": 0,
               "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "allocated_size": allocated, "active_size": allocated,
               "requested_size": sum(b["requested_size"] for b in active), "frames": [],
               "blocks": blocks}
    return {"segments": [segment] if total else [], "device_traces": [trace], EMBED_KEY: snap}


def save_torch_snapshot(snap: dict[str, Any], path: str | os.PathLike) -> None:
    """Write :func:`torch_snapshot` of ``snap`` to ``path`` as ``_dump_snapshot`` does (a
    pickle), atomically (a temporary file renamed into place)."""
    data = pickle.dumps(torch_snapshot(snap), protocol=PICKLE_PROTOCOL)
    with atomic_path(path, ".pickle", "memory snapshot") as tmp, open(tmp, "wb") as f:
        f.write(data)


class _PlainUnpickler(pickle.Unpickler):
    """Reads plain data only (dicts, lists, tuples, strings, numbers): a pickle naming any
    class or function is refused instead of run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}: not plain data")


def load_pickle(path: str | os.PathLike) -> Any:
    """The plain data of a pickle file (``ValueError`` if it holds anything else)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        try:
            return _PlainUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError,
                IndexError, AttributeError, MemoryError) as e:
            raise ValueError(f"{path} is not a readable memory snapshot pickle ({e})") from None


def minidl_snapshot(data: Any, path: str | os.PathLike) -> dict[str, Any]:
    """The minidl snapshot inside a pickle :func:`save_torch_snapshot` wrote; ``ValueError``
    saying how to open it for PyTorch's own snapshots and what it is otherwise."""
    path = os.fspath(path)
    if isinstance(data, dict):
        inner = data.get(EMBED_KEY)
        if isinstance(inner, dict) and inner.get("format") == SNAPSHOT_FORMAT:
            return inner
        if "segments" in data or "device_traces" in data:
            raise ValueError(f"{path} is a PyTorch memory snapshot (torch.cuda.memory."
                             f"_dump_snapshot's format) without minidl's record: "
                             + open_hint(path))
    elif isinstance(data, list):  # (torch's readers take a bare list of segments too)
        raise ValueError(f"{path} is a list of PyTorch allocator segments: " + open_hint(path))
    raise ValueError(f"{path} is a pickle but not a memory snapshot (written by minidl train "
                     "--snapshot FILE.pickle or torch.cuda.memory._dump_snapshot)")
