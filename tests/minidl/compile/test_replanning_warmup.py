"""Issue 45: re-planning on measured step times leaves out the first iteration (compilation
and warm-up): a ``swap=auto`` / ``auto`` plan is re-planned from a warm iteration's times."""

from __future__ import annotations

import numpy as np

import minidl
from minidl import layers as L
from minidl.compile.replanning import WARM_RUNS
from minidl.net.optim import SGD


def _trainer(spec: str) -> minidl.Trainer:
    net = minidl.Sequential([L.Conv2d(1, 4, 3, padding=1), L.ReLU(), L.MaxPool2d(2),
                             L.Flatten(), L.Linear(4 * 4 * 4, 3)], input_shape=(1, 8, 8))
    return minidl.Trainer(net, SGD(net.parameters(), lr=0.1), memory=spec,
                          device_memory="16MiB")


def test_timed_replanning_waits_for_a_warm_iteration():
    tr = _trainer("reuse,swap=auto")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 1, 8, 8)).astype(np.float32)
    y = np.arange(4) % 3
    measured = []
    for _ in range(WARM_RUNS + 1):
        tr.step(x, y)
        measured.append(tr.last_compiled.plan.provenance.measured)
    # the plan each step ran: timed from measurements only once a warm iteration has run
    assert measured[:WARM_RUNS] == [False] * WARM_RUNS
    assert measured[WARM_RUNS] is True
    assert WARM_RUNS >= 2
