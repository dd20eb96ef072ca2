"""Learning-rate schedules (StepLR, CosineAnnealingLR, warmup): the rates PyTorch's schedulers
give, their formulas, their state."""

from __future__ import annotations

import math

import numpy as np
import pytest

from minidl.net.optim import (
    SGD,
    CosineAnnealingLR,
    LambdaLR,
    StepLR,
)
from minidl.net.parameter import Parameter


def _params() -> list[Parameter]:
    """Parameters for an optimizer whose learning rate is all a schedule reads."""
    return [Parameter("p0", np.zeros((3, 4), np.float32))]


def _our_lrs(make, n, lr=0.1):
    opt = SGD(_params(), lr=lr)
    sched = make(opt)
    out = [opt.lr]
    for _ in range(n):
        sched.step()
        out.append(opt.lr)
        assert sched.get_last_lr() == opt.lr
    return out


def _torch_lrs(torch, make, n, lr=0.1):
    t = torch.zeros(2, requires_grad=True)
    opt = torch.optim.SGD([t], lr=lr)
    sched = make(opt)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(n):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_schedules_match_torch():
    torch = pytest.importorskip("torch")
    ts = torch.optim.lr_scheduler
    cases = [
        (lambda o: StepLR(o, 3), lambda o: ts.StepLR(o, 3)),
        (lambda o: StepLR(o, 2, gamma=0.5), lambda o: ts.StepLR(o, 2, gamma=0.5)),
        (lambda o: CosineAnnealingLR(o, 10), lambda o: ts.CosineAnnealingLR(o, 10)),
        (lambda o: CosineAnnealingLR(o, 7, eta_min=0.01),
         lambda o: ts.CosineAnnealingLR(o, 7, eta_min=0.01)),
        (lambda o: LambdaLR(o, lambda t: 1 / (1 + t)),
         lambda o: ts.LambdaLR(o, lambda t: 1 / (1 + t))),
    ]
    for ours, theirs in cases:
        np.testing.assert_allclose(_our_lrs(ours, 25), _torch_lrs(torch, theirs, 25),
                                   rtol=1e-9, atol=1e-12)


def test_schedule_formulas_and_warmup():
    lrs = _our_lrs(lambda o: StepLR(o, 2, gamma=0.1), 5, lr=1.0)
    np.testing.assert_allclose(lrs, [1, 1, 0.1, 0.1, 0.01, 0.01])
    cos = _our_lrs(lambda o: CosineAnnealingLR(o, 4), 8, lr=1.0)
    np.testing.assert_allclose(cos, [1, 0.853553, 0.5, 0.146447, 0, 0.146447, 0.5, 0.853553, 1],
                               atol=1e-6)
    warm = _our_lrs(lambda o: CosineAnnealingLR(o, 100, warmup_steps=3), 4, lr=1.0)
    base = [(1 + math.cos(math.pi * t / 100)) / 2 for t in range(5)]
    np.testing.assert_allclose(warm, [base[0] / 4, base[1] * 2 / 4, base[2] * 3 / 4,
                                      base[3], base[4]])
    assert all(a < b for a, b in zip(warm[:3], warm[1:4], strict=True))
    const = _our_lrs(lambda o: LambdaLR(o, lambda t: 1.0, warmup_steps=4), 5, lr=0.5)
    np.testing.assert_allclose(const, [0.1, 0.2, 0.3, 0.4, 0.5, 0.5])
    with pytest.raises(ValueError):
        StepLR(SGD(_params(), lr=0.1), 0)
    with pytest.raises(ValueError):
        CosineAnnealingLR(SGD(_params(), lr=0.1), 10, warmup_steps=-1)


def test_schedule_state_dict():
    opt = SGD(_params(), lr=0.2)
    sched = CosineAnnealingLR(opt, 10)
    for _ in range(4):
        sched.step()
    saved = sched.state_dict()
    opt2 = SGD(_params(), lr=0.2)
    sched2 = CosineAnnealingLR(opt2, 10)
    sched2.load_state_dict(saved)
    assert opt2.lr == opt.lr
    sched.step()
    sched2.step()
    assert opt2.lr == opt.lr
