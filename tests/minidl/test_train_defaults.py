"""Per-dataset defaults of ``minidl train``: standardised digits and their weight decay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minidl import data as D
from minidl.cli import main


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
    np.testing.assert_allclose(ds.mean, mean, rtol=1e-6)
    np.testing.assert_allclose(ds.std, std, rtol=1e-6)
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
    from minidl.models import lenet5

    small, large = lenet5((1, 8, 8)), lenet5((1, 28, 28))
    # fc1 sees 16 maps of 4x4 on 8x8 inputs (one pooling), 5x5 on 28x28 (two poolings).
    assert small.state_dict()["fc1.weight"].shape == (120, 16 * 4 * 4)
    assert large.state_dict()["fc1.weight"].shape == (120, 16 * 5 * 5)
    assert large.num_parameters() == 61_706  # LeNet-5's classic count
