"""Per-dataset defaults of ``minidl train``: standardised digits and their weight decay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minidl.cli import main
from minidl.datasets import data as D


def _dataset() -> D.Dataset:
    rng = np.random.default_rng(0)
    x_train = rng.uniform(0, 1, (40, 2, 3, 3)).astype(np.float32)
    x_train[:, 1] = x_train[:, 1] * 4 + 2  # a second channel with other statistics
    x_test = rng.uniform(0, 1, (10, 2, 3, 3)).astype(np.float32)
    y = np.zeros(50, dtype=np.int64)
    return D.Dataset(x_train, y[:40], x_test, y[40:], 1, (2, 3, 3), "toy")


def test_standardize_uses_the_train_statistics_per_channel():
    ds = _dataset()
    raw_train, raw_test = ds.x_train.copy(), ds.x_test.copy()
    ds.standardize()
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-6)
    np.testing.assert_allclose(ds.x_train.std(axis=(0, 2, 3)), 1, atol=1e-5)
    mean = raw_train.mean(axis=(0, 2, 3), dtype=np.float64)
    std = raw_train.std(axis=(0, 2, 3), dtype=np.float64)
    np.testing.assert_allclose(ds.standardization.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(ds.standardization.std, std, rtol=1e-6)
    # The test split gets the train split's transform, not its own statistics.
    want = (raw_test - mean[None, :, None, None]) / std[None, :, None, None]
    np.testing.assert_allclose(ds.x_test, want, rtol=1e-5, atol=1e-6)
    assert ds.x_train.dtype == ds.x_test.dtype == np.float32
    with pytest.raises(ValueError, match="already standardised"):
        ds.standardize()


def test_digits_defaults_differ_from_the_generic_ones():
    digits, other = D.train_defaults("digits"), D.train_defaults("mnist")
    assert digits.standardize and not other.standardize
    assert digits.weight_decay > other.weight_decay
    assert other == D.TrainDefaults()


def _train_json(capsys, *flags):
    pytest.importorskip("sklearn")
    assert main(["train", "lenet5", "--max-steps", "1", "--json", "--no-progress", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_applies_the_digits_defaults(capsys):
    res = _train_json(capsys, "--dataset", "digits")
    train = D.load_digits(seed=0).x_train
    assert res["input_mean"] == pytest.approx([float(train.mean(dtype=np.float64))], rel=1e-6)
    assert res["input_std"] == pytest.approx([float(train.std(dtype=np.float64))], rel=1e-6)
    assert res["weight_decay"] == D.train_defaults("digits").weight_decay
    assert res["epochs"] == D.train_defaults("digits").epochs


def test_flags_on_the_command_line_win_and_other_datasets_keep_raw_inputs(capsys):
    res = _train_json(capsys, "--dataset", "digits", "--weight-decay", "1e-4", "--epochs", "3")
    assert res["weight_decay"] == 1e-4 and res["epochs"] == 3
    res = _train_json(capsys, "--dataset", "synthetic", "--input", "1x8x8")
    assert res["input_mean"] is None and res["input_std"] is None
    assert res["weight_decay"] == D.TrainDefaults().weight_decay


def test_lenet5_pools_once_on_8x8_digits_and_twice_on_larger_inputs():
    from minidl.zoo.models import lenet5

    small, large = lenet5((1, 8, 8)), lenet5((1, 28, 28))
    # fc1 sees 16 maps of 4x4 on 8x8 inputs (one pooling), 5x5 on 28x28 (two poolings).
    assert small.state_dict()["fc1.weight"].shape == (120, 16 * 4 * 4)
    assert large.state_dict()["fc1.weight"].shape == (120, 16 * 5 * 5)
    assert large.num_parameters() == 61_706  # LeNet-5's classic count


def test_random_shift_moves_by_at_most_one_pixel_and_fills_the_border():
    rng = np.random.default_rng(0)
    x = rng.uniform(1, 2, (200, 2, 5, 5)).astype(np.float32)
    fill = (-1.0, -3.0)
    out = D.random_shift(x, np.random.default_rng(1), probability=1.0, fill=fill)
    assert out.shape == x.shape and out.dtype == x.dtype
    seen = set()
    for img, src in zip(out, x):
        matches = []
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                want = np.empty_like(src)
                want[0], want[1] = fill
                want[:, max(dy, 0):5 + min(dy, 0), max(dx, 0):5 + min(dx, 0)] = \
                    src[:, max(-dy, 0):5 - max(dy, 0), max(-dx, 0):5 - max(dx, 0)]
                if np.array_equal(img, want):
                    matches.append((dy, dx))
        assert len(matches) == 1
        seen.add(matches[0])
    assert len(seen) == 9  # every move, (0, 0) included, occurs among 200 images
    kept = D.random_shift(x, np.random.default_rng(1), probability=0.0)
    np.testing.assert_array_equal(kept, x)
    half = D.random_shift(x, np.random.default_rng(2), probability=0.5)
    moved = np.mean([not np.array_equal(a, b) for a, b in zip(half, x)])
    assert 0.3 < moved < 0.6  # about half minus the 1/9 drawn as (0, 0)
    with pytest.raises(ValueError, match="probability"):
        D.random_shift(x, rng, probability=1.5)


def test_fit_trains_on_the_augmented_batches():
    from minidl.train.trainer import Trainer
    from minidl.zoo.models import lenet5

    ds = D.load_synthetic((1, 8, 8), 10, n_train=64, n_test=16, seed=0)
    seen = []

    def augment(xb, rng):
        seen.append(xb.copy())
        return np.zeros_like(xb)

    trainer = Trainer(lenet5((1, 8, 8)), memory="none", seed=3)
    stepped = []
    step = trainer.step
    trainer.step = lambda xb, yb: stepped.append(xb.copy()) or step(xb, yb)
    trainer.fit(ds, epochs=1, batch_size=16, progress=False, evaluate=False, augment=augment)
    assert len(seen) == len(stepped) == 4
    assert not any(np.array_equal(x, np.zeros_like(x)) for x in seen)
    assert all(np.array_equal(x, np.zeros_like(x)) for x in stepped)  # what augment returned


def test_train_applies_label_smoothing_and_shifts_on_digits(capsys, monkeypatch):
    from minidl.commands import train as train_cmd

    smoothing, shifted = [], []
    real_loss, real_shift = train_cmd.SoftmaxCrossEntropy, D.random_shift

    def loss(label_smoothing=0.0):
        smoothing.append(label_smoothing)
        return real_loss(label_smoothing=label_smoothing)

    def shift(x, rng, probability=1.0, fill=0.0):
        shifted.append((probability, fill))
        return real_shift(x, rng, probability, fill)

    monkeypatch.setattr(train_cmd, "SoftmaxCrossEntropy", loss)
    monkeypatch.setattr(D, "random_shift", shift)
    res = _train_json(capsys, "--dataset", "digits", "--max-steps", "3")
    digits = D.train_defaults("digits")
    assert smoothing == [digits.label_smoothing] and digits.label_smoothing > 0
    assert len(shifted) == 3 and digits.shift_probability > 0
    probability, fill = shifted[0]
    assert probability == digits.shift_probability
    # The border is a blank pixel after standardisation.
    assert fill == pytest.approx((-res["input_mean"][0] / res["input_std"][0],))
    assert res["label_smoothing"] == digits.label_smoothing
    assert res["shift_probability"] == digits.shift_probability
    smoothing.clear(), shifted.clear()
    _train_json(capsys, "--dataset", "synthetic", "--input", "1x8x8")
    assert smoothing == [0.0] and shifted == []
