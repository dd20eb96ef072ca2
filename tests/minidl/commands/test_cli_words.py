"""Issue 49, the last words and numbers: the training loss a run reports is an epoch's mean
(or, inside an epoch, the mean since the last whole one), a wrong model's state_dict error
names a few keys and a count, and a meta device's snapshot says it has no capacity limit."""

from __future__ import annotations

import json

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.analysis.memory_record import show_memory
from minidl.cli import main
from minidl.net.graph import listed_names


def test_final_loss_is_the_mean_of_the_steps_inside_an_unfinished_epoch(capsys):
    assert main(["train", "lenet5", "--dataset", "synthetic", "--max-steps", "3",
                 "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final_loss"] == pytest.approx(np.mean(out["losses"]))
    assert out["final_loss_over"] == "mean of the last 3 steps, inside an epoch"
    assert out["last_step_loss"] == out["losses"][-1]


def test_final_loss_of_a_whole_epoch_is_its_mean(capsys):
    assert main(["train", "lenet5", "--dataset", "digits", "--epochs", "1", "--no-progress",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["final_loss"] == pytest.approx(out["epoch_logs"][-1]["loss"])
    assert out["final_loss_over"] == "epoch 1's mean"
    assert out["final_loss"] != out["losses"][-1]


def test_state_dict_mismatch_names_a_few_and_counts():
    assert listed_names([]) == "none"
    assert listed_names(["a", "b"]) == "a, b"
    names = [f"layer{i}.weight" for i in range(300)]
    assert listed_names(names) == "layer0.weight, layer1.weight, layer2.weight, " \
                                  "layer3.weight, ... (300 in all)"
    net = minidl.Sequential([L.Linear(4, 3)], input_shape=(4,))
    wrong = {f"x{i}": np.zeros(1, np.float32) for i in range(200)}
    with pytest.raises(KeyError) as e:
        net.load_state_dict(wrong)
    text = str(e.value)
    assert "(200 in all)" in text and len(text) < 300


def test_meta_snapshot_says_no_capacity_limit(tmp_path, capsys):
    snap = tmp_path / "p.json"
    assert main(["plan", "lenet5", "--input", "1x28x28", "--batch-size", "8",
                 "--snapshot", str(snap)]) == 0
    capsys.readouterr()
    text = show_memory(snap)
    assert "meta device (no capacity limit)" in text and "EiB" not in text
    assert "program step" in text


def test_val_every_zero_means_never(capsys):
    assert main(["train", "lenet5", "--dataset", "digits", "--epochs", "1", "--no-progress",
                 "--json", "--val-every", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all("val_loss" not in e for e in out["epoch_logs"])
    assert main(["train", "lenet5", "--dataset", "digits", "--epochs", "1", "--no-progress",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "val_loss" in out["epoch_logs"][-1]  # (the default validates every epoch)
