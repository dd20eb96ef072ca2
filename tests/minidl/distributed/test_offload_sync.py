"""Data parallelism under offload=optimizer without MPI (minidl.distributed.offload_sync): the
buckets go as their gradients land in the host's buffers, scaled in place, in bucket order.
(Two ranks against plain data parallelism and one process: test_data_parallel.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import minidl.memory.planners.planner as planner
from minidl.distributed.offload_sync import OffloadSync
from minidl.memory.passes.offload_state import offload_state_plan
from minidl.net.optim import Adam
from minidl.train.trainer import Trainer
from minidl.zoo import models


class _Recording:
    """A pretend rank 0 of 2 whose all-reduce records each bucket's contents (sums nothing)."""

    rank, size, name = 0, 2, "recording"

    def __init__(self):
        self.calls: list[np.ndarray] = []

    def allreduce(self, buf):
        self.calls.append(buf.copy())


def _offloading_trainer():
    net = models.smallcnn((1, 8, 8), 10, width=4)
    return net, Trainer(net, Adam(net.parameters(), lr=0.01),
                        memory="reuse,inplace,offload=optimizer", device_memory="8MiB")


def test_buckets_go_as_their_gradients_land_and_hold_the_scaled_gradients(monkeypatch):
    # every gradient its own copy to the host (the plan's buckets of 4 MiB would take the
    # whole small network's gradients after backward)
    monkeypatch.setattr(planner, "offload_state_plan", lambda plan: offload_state_plan(plan, 1))
    net, trainer = _offloading_trainer()
    x = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = np.arange(4)
    trainer._local_gradients(x, y)  # one process: the gradients as they land
    grads = [p.grad.copy() for p in net.parameters()]
    trainer._local_gradients(-x, y)  # the buffers then hold other gradients
    comm = _Recording()
    sync = OffloadSync(comm, net.parameters(), trainer.engine.host_state, bucket_bytes=1)
    trainer.parallel = SimpleNamespace(after_backward_step=sync.on_backward_step,
                                       before_step=None, batch_sync=None)
    sync.begin(0.5)
    trainer._local_gradients(x, y)
    # launched during backward once landed; the last copies land when the iteration ends
    assert 0 < sync.unlaunched < len(sync.buckets)
    sync.finish()
    sync.close()
    assert len(comm.calls) == len(grads)
    for sent, g in zip(comm.calls, grads[::-1]):  # fc.bias first, conv1.weight last
        assert np.array_equal(sent[:g.size], (g * np.float32(0.5)).reshape(-1))
        assert not np.any(sent[g.size:])  # the alignment bytes zeroed
    for p, g in zip(net.parameters(), grads):
        assert np.array_equal(p.grad, g * np.float32(0.5))  # in place: the update reads them
    trainer.parallel = None
    trainer.close()


def test_a_rank_without_rows_adds_zeros_and_the_order_is_checked():
    net, trainer = _offloading_trainer()
    host = trainer.engine.host_state
    comm = _Recording()
    sync = OffloadSync(comm, net.parameters(), host, bucket_bytes=1 << 20)
    host.flat_gradients()[...] = 1
    sync.begin(0.0)
    sync.zero_local()
    sync.finish()
    sync.close()
    assert len(comm.calls) == 1 and not np.any(comm.calls[0])
    with pytest.raises(ValueError, match="every trainable parameter of the network, in the "
                                         "network's order"):
        OffloadSync(comm, net.parameters()[::-1], host)
    trainer.close()
