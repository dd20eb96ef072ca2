"""The recording stream/event model: unordered conflicting accesses across streams fail."""

from __future__ import annotations

import pytest

from minidl.memory.testing.stream_model import StreamModel, StreamRace

BLOCK = ((0, 256),)
OTHER = ((512, 768),)


def test_work_on_one_stream_is_ordered():
    m = StreamModel()
    m.issue("compute", writes=BLOCK, what="producer")
    m.issue("compute", reads=BLOCK, writes=BLOCK, what="consumer")
    assert m.issued == 2


def test_copy_reading_before_its_producer_is_a_race():
    m = StreamModel()
    m.issue("compute", writes=BLOCK, what="conv1 forward")
    with pytest.raises(StreamRace, match="conv1 forward"):
        m.issue("d2h", reads=BLOCK, what="offload")


def test_copy_after_an_event_on_the_producer_is_ordered():
    m = StreamModel()
    m.issue("compute", writes=BLOCK, what="conv1 forward")
    m.wait_event("d2h", m.record("compute"))
    m.issue("d2h", reads=BLOCK, what="offload")


def test_prefetch_into_a_block_a_queued_kernel_reads_is_a_race():
    m = StreamModel()
    m.issue("compute", reads=BLOCK, writes=OTHER, what="relu reads the old tensor")
    with pytest.raises(StreamRace, match="relu"):
        m.issue("h2d", writes=BLOCK, what="prefetch")
    m2 = StreamModel()
    m2.issue("compute", reads=BLOCK, writes=OTHER, what="relu")
    m2.wait_event("h2d", m2.record("compute"))
    m2.issue("h2d", writes=BLOCK, what="prefetch")


def test_compute_reading_a_prefetched_block_must_wait_for_the_copy():
    m = StreamModel()
    m.issue("h2d", writes=BLOCK, what="prefetch")
    with pytest.raises(StreamRace, match="prefetch"):
        m.issue("compute", reads=BLOCK, what="backward")
    for order in ("device", "host"):
        m = StreamModel()
        m.issue("h2d", writes=BLOCK, what="prefetch")
        ev = m.record("h2d")
        if order == "device":
            m.wait_event("compute", ev)
        else:
            m.host_wait(ev)
        m.issue("compute", reads=BLOCK, what="backward")


def test_disjoint_bytes_and_concurrent_reads_need_no_event():
    m = StreamModel()
    m.issue("compute", writes=BLOCK, what="a")
    m.issue("d2h", reads=OTHER, what="b")          # other bytes
    m2 = StreamModel()
    m2.issue("compute", reads=BLOCK, what="a")
    m2.issue("d2h", reads=BLOCK, what="b")         # two readers


def test_ordering_is_transitive_and_prune_keeps_it():
    m = StreamModel()
    m.issue("compute", writes=BLOCK, what="k1")
    m.wait_event("d2h", m.record("compute"))
    m.issue("d2h", reads=BLOCK, what="c1")
    m.issue("d2h", writes=OTHER, what="c2")
    m.wait_event("compute", m.record("d2h"))
    m.prune()
    m.issue("compute", reads=OTHER, writes=BLOCK, what="k2")  # after c1 (read) and c2 (write)
    with pytest.raises(StreamRace):
        m.issue("d2h", reads=BLOCK, what="c3")  # k2 wrote BLOCK after the last event


def test_the_two_copy_directions_are_separate_streams():
    """An offload and a prefetch into the same block are unordered unless an event orders
    them (here through compute, as the runtime does: release waits for the offload, and the
    prefetch's stream waits for compute)."""
    m = StreamModel()
    m.issue("d2h", reads=BLOCK, what="offload")
    with pytest.raises(StreamRace, match="offload"):
        m.issue("h2d", writes=BLOCK, what="prefetch")
    m = StreamModel()
    m.issue("d2h", reads=BLOCK, what="offload")
    m.wait_event("compute", m.record("d2h"))   # release: compute follows the offload
    m.wait_event("h2d", m.record("compute"))   # the prefetch follows compute
    m.issue("h2d", writes=BLOCK, what="prefetch")


def test_unknown_stream():
    with pytest.raises(ValueError, match="unknown stream"):
        StreamModel().issue("dma")
