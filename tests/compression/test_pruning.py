"""Magnitude pruning: masks, the schedule, and pruned weights staying zero through SGD and
Adam steps (momentum, weight decay) in a real Trainer."""

from __future__ import annotations

import numpy as np
import pytest

from minidl import Trainer
from minidl.compression.layer_spec import compressible_weights
from minidl.compression.pruning import MaskedOptimizer, magnitude_mask, schedule
from minidl.net.optim import SGD, Adam, AdamW
from minidl.zoo.models import get_model


def test_magnitude_mask_prunes_the_smallest():
    w = np.array([[0.5, -0.1, 0.0], [2.0, -0.3, 0.05]])
    assert magnitude_mask(w, 0.5).tolist() == [[True, False, False], [True, True, False]]
    assert magnitude_mask(w, 0.0).all()
    assert magnitude_mask(w, 0.99).sum() == 0


def test_schedule_reaches_the_target_geometrically():
    fr = schedule(0.875, 3)
    np.testing.assert_allclose(fr, [0.5, 0.75, 0.875])
    assert schedule(0.9, 1) == [0.9]
    with pytest.raises(ValueError):
        schedule(0.5, 0)


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    lambda ps: Adam(ps, lr=1e-2, weight_decay=1e-2),
    lambda ps: AdamW(ps, lr=1e-2),
])
def test_pruned_weights_stay_zero_through_training(make):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 16)
    net = get_model("lenet5", input_shape=(1, 8, 8), num_classes=10)
    weights = {c.param.name: c.param for c in compressible_weights(net)}
    masks = {n: magnitude_mask(p.data, 0.7) for n, p in weights.items()}
    opt = MaskedOptimizer(make(net.parameters()), masks)
    t = Trainer(net, opt, device_memory="16MiB")
    opt.apply()
    before = {n: p.data.copy() for n, p in weights.items()}
    grads_there = False
    for _ in range(4):
        t.compute_gradients(x, y)
        grads_there |= any(np.abs(p.grad[~masks[n]]).max() > 0 for n, p in weights.items())
        opt.step()
    assert grads_there  # without the mask, pruned weights would have moved
    for n, p in weights.items():
        assert (p.data[~masks[n]] == 0).all()
        assert not np.array_equal(p.data[masks[n]], before[n][masks[n]])  # the rest trains
    for name, arr in opt.inner.state.items():  # momentum / moments of pruned weights stay 0
        base = name.rsplit(".", 1)[0]
        if base in masks:
            assert (arr[~masks[base]] == 0).all()
    t.close()


def test_masks_must_name_trained_parameters():
    net = get_model("lenet5", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ValueError, match="does not update: nope"):
        MaskedOptimizer(SGD(net.parameters(), lr=0.1), {"nope": np.ones(3, bool)})
