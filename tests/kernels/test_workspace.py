"""Named workspace layouts: sizing and carving agree, buffers are disjoint and reached by
name, nested layouts keep declaration order."""

import numpy as np
import pytest

from minidl.kernels.workspace import Layout, workspace_bytes, workspace_views


def _span(a, base):
    start = a.__array_interface__["data"][0] - base
    return start, start + a.nbytes


def test_layout_sizes_and_carves_in_declaration_order():
    worker = Layout.of(xs=(3, 5), hw=(7,))
    layout = Layout.of(ring=(2, 3, 4), workers=(worker, worker), empty=(0,), table=(11, 2))
    assert layout.shapes() == [(2, 3, 4), (3, 5), (7,), (3, 5), (7,), (0,), (11, 2)]
    nbytes = layout.nbytes(np.float32)
    assert nbytes == workspace_bytes(np.float32, *layout.shapes())
    ws = np.zeros(nbytes, np.uint8)
    bufs = layout.carve(ws, np.float32)
    flat = workspace_views(ws, np.float32, *layout.shapes())
    named = [bufs.ring, bufs.workers[0].xs, bufs.workers[0].hw, bufs.workers[1].xs,
             bufs.workers[1].hw, bufs.empty, bufs["table"]]
    base = ws.__array_interface__["data"][0]
    for a, b in zip(named, flat):
        assert a.shape == b.shape and a.dtype == np.float32
        assert _span(a, base) == _span(b, base)
    spans = sorted(_span(a, base) for a in named if a.size)
    assert all(s % 64 == 0 for s, _ in spans)
    assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))  # disjoint
    assert spans[-1][1] <= nbytes


def test_buffers_are_named_and_read_only():
    bufs = Layout.of(a=(2,), sub=Layout.of(b=(3,))).carve(np.zeros(256, np.uint8), np.float64)
    assert list(bufs) == ["a", "sub"] and bufs.sub.b.shape == (3,)
    with pytest.raises(AttributeError, match="no workspace buffer named 'c'"):
        bufs.c  # noqa: B018
    with pytest.raises(AttributeError):
        bufs.a = np.zeros(2)


def test_a_tuple_of_layouts_cannot_mix_in_shapes():
    with pytest.raises(TypeError):
        Layout.of(bad=(Layout.of(a=(1,)), (2,)))
