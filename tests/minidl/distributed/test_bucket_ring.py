"""The buckets' host buffers as a ring: two slots while buckets are summed in order, a wait
only for a launched bucket, a new slot instead of a deadlock when they fill out of order."""

from __future__ import annotations

import threading
import time

import numpy as np

from minidl.distributed.bucket_ring import BucketRing


def test_buckets_in_order_share_two_slots_and_wait_for_a_launched_one():
    ring = BucketRing([10, 6, 8], [np.float32] * 3)
    a = ring.take(0)
    a[...] = 1
    ring.launch(0)
    b = ring.take(1)
    assert b.shape == (6,) and b.dtype == np.float32
    ring.launch(1)
    got: list[np.ndarray] = []
    waiter = threading.Thread(target=lambda: got.append(ring.take(2)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # every slot held by a launched bucket: it waits for one
    ring.give_back(0)
    waiter.join(5)
    assert got and got[0].shape == (8,)
    assert np.shares_memory(got[0], a)  # bucket 0's slot
    assert ring.nbytes == 2 * 40


def test_buckets_filling_out_of_order_get_a_new_slot_instead_of_waiting():
    ring = BucketRing([4, 4, 4], [np.float64] * 3)
    ring.take(0)
    ring.take(1)  # neither launched: their collectives cannot end before they are
    c = ring.take(2)
    assert c.shape == (4,) and ring.nbytes == 3 * 32
    ring.reset()  # a new step: every slot free, none made anew
    for k in range(3):
        ring.take(k)
    assert ring.nbytes == 3 * 32
