"""Callbacks of fit: hook order, per-epoch validation, early stopping, checkpoints of the best
epoch, CSV / JSON-lines metric logs, TensorBoard (when installed), through the API and the CLI;
progress output fit for log files when not on a terminal."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidl import Sequential, Trainer, layers
from minidl.cli import main
from minidl.datasets.data import Dataset
from minidl.net.optim import SGD, StepLR
from minidl.train.callbacks import (
    CSV_COLUMNS,
    Callback,
    EarlyStopping,
    MetricLogger,
    ModelCheckpoint,
    ProgressLogger,
    TensorBoard,
    tensorboard_writer,
)


def _data(noise: bool = False) -> Dataset:
    rng = np.random.default_rng(2)
    y = rng.integers(0, 3, 60)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    if not noise:
        x[np.arange(60), y] += 3.0  # learnable
    return Dataset(x[:40], y[:40], x[40:], y[40:], 3, (4,), "toy")


def _trainer(lr: float = 0.1) -> Trainer:
    net = Sequential([layers.Linear(4, 8), layers.ReLU(), layers.Linear(8, 3)], input_shape=(4,))
    opt = SGD(net.parameters(), lr=lr, momentum=0.9)
    return Trainer(net, opt, device_memory="4MiB", scheduler=StepLR(opt, 2, gamma=0.5))


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_train_begin(self, run):
        self.calls.append("train_begin")

    def on_epoch_begin(self, run, epoch):
        self.calls.append(f"epoch_begin {epoch}")

    def on_step_end(self, run, logs):
        self.calls.append(f"step {logs['step']}")

    def on_evaluate(self, run, logs):
        self.calls.append(f"evaluate {logs['epoch']}")

    def on_epoch_end(self, run, logs):
        self.calls.append(f"epoch_end {logs['epoch']} lr {logs['lr']}")

    def on_train_end(self, run, logs):
        self.calls.append(f"train_end {logs['steps']}")


def test_hooks_in_order_with_validation_every_other_epoch():
    rec = Recorder()
    h = _trainer().fit(_data(), epochs=4, batch_size=20, progress=False, callbacks=[rec],
                       val_every=2)
    assert rec.calls == [
        "train_begin",
        "epoch_begin 0", "step 1", "step 2", "epoch_end 0 lr 0.1",
        "epoch_begin 1", "step 3", "step 4", "evaluate 1", "epoch_end 1 lr 0.1",
        "epoch_begin 2", "step 5", "step 6", "epoch_end 2 lr 0.05",
        "epoch_begin 3", "step 7", "step 8", "evaluate 3", "epoch_end 3 lr 0.05",
        "train_end 8"]
    assert [("val_loss" in e) for e in h.epochs] == [False, True, False, True]
    assert h.lrs == [0.1] * 4 + [0.05] * 4
    assert h.epochs[-1]["val_accuracy"] == pytest.approx(h.test.accuracy)


def test_early_stopping_stops_when_val_loss_stalls():
    # lr 0 never improves: the first epoch sets the best, the next `patience` do not beat it
    tr = _trainer(lr=0.0)
    stop = EarlyStopping(patience=2)
    h = tr.fit(_data(), epochs=10, batch_size=20, progress=False, callbacks=[stop],
               validation_data=(_data().x_test, _data().y_test))
    assert len(h.epochs) == 3 and h.stopping.early and "val_loss" in h.stopping.reason
    learning = _trainer().fit(_data(), epochs=6, batch_size=20, progress=False,
                              callbacks=[EarlyStopping(patience=2)], val_every=1)
    assert not learning.stopping.early and len(learning.epochs) == 6
    with pytest.raises(ValueError, match="does not validate"):  # (it would by default)
        _trainer().fit(_data(), epochs=1, batch_size=20, progress=False,
                       callbacks=[EarlyStopping()], val_every=0)


def test_checkpoint_of_the_best_epoch(tmp_path):
    ck = ModelCheckpoint(tmp_path / "best-{epoch}.npz", save_best=True, monitor="val_accuracy")
    tr = _trainer()
    h = tr.fit(_data(), epochs=4, batch_size=20, progress=False, callbacks=[ck], val_every=1)
    accs = [e["val_accuracy"] for e in h.epochs]
    best = [i for i, a in enumerate(accs) if a > max(accs[:i], default=-1)]
    assert ck.saved == [str(tmp_path / f"best-{i + 1}.npz") for i in best]
    restored = _trainer()
    restored.load(ck.saved[-1], resume=True)
    assert restored.fit_state.epoch == best[-1] + 1
    with pytest.raises(ValueError, match="every_n_epochs=N or save_best"):
        ModelCheckpoint(tmp_path / "x.npz")


@pytest.mark.parametrize("name", ["log.csv", "log.jsonl"])
def test_metric_log_rows_per_epoch_and_every_n_steps(tmp_path, name):
    path = tmp_path / name
    tr = _trainer()
    h = tr.fit(_data(), epochs=2, batch_size=10, progress=False, val_every=1,
               callbacks=[MetricLogger(path, every_steps=3)])
    text = path.read_text()
    if name.endswith(".csv"):
        rows = list(csv.DictReader(io.StringIO(text)))
        assert tuple(rows[0]) == CSV_COLUMNS
    else:
        rows = [json.loads(line) for line in text.splitlines()]
    assert [(r["kind"], int(r["step"])) for r in rows] == [
        ("step", 3), ("epoch", 4), ("step", 6), ("epoch", 8)]
    assert float(rows[1]["loss"]) == pytest.approx(np.mean(h.losses[:4]))
    assert float(rows[3]["val_loss"]) == pytest.approx(h.epochs[1]["val_loss"])
    # a resumed run appends
    tr.fit(_data(), epochs=3, batch_size=10, progress=False,
           callbacks=[MetricLogger(path, append=True)])
    assert len(path.read_text().splitlines()) == len(text.splitlines()) + 1


def test_tensorboard_scalars(tmp_path):
    try:
        tensorboard_writer(str(tmp_path / "probe")).close()
    except ImportError as e:
        pytest.skip(f"TensorBoard logging is optional: {e}")
    tb = TensorBoard(tmp_path / "tb", every_steps=1)
    _trainer().fit(_data(), epochs=1, batch_size=20, progress=False, callbacks=[tb])
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    cb = ProgressLogger(out, every_steps=2)
    _trainer().fit(_data(), epochs=2, batch_size=10, evaluate=False, progress=False,
                   callbacks=[cb], val_every=2)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split(":")[0] for ln in lines] == [
        "step 2/8 (epoch 1)", "step 4/8 (epoch 1)", "epoch 1/2",
        "step 6/8 (epoch 2)", "step 8/8 (epoch 2)", "epoch 2/2"]
    assert "val_loss" in lines[-1] and "val_loss" not in lines[2]


def test_cli_progress_is_one_line_per_epoch_in_a_log(tmp_path):
    """stdout and stderr captured (a log file, not a terminal): no carriage returns."""
    log = tmp_path / "m.jsonl"
    env = {**os.environ, "MINIDL_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "minidl", "train", "smallcnn", "--dataset",
                        "synthetic", "--input", "1x8x8", "--epochs", "3", "--batch-size", "64",
                        "--log", str(log), "--early-stopping", "5"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr
    epochs = [ln for ln in p.stderr.splitlines() if ln.startswith("epoch ")]
    assert [ln.split(":")[0] for ln in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all("val_loss" in ln for ln in epochs)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0, 1, 2] and all("val_loss" in r for r in rows)


@pytest.mark.parametrize("argv,needle", [
    (["--save-every", "5"], "add --save"),
    (["--early-stopping", "0"], "--early-stopping must be >= 1"),
    (["--log", "/nonexistent/dir/m.csv"], "--log /nonexistent/dir/m.csv"),
])
def test_cli_flag_errors(capsys, argv, needle):
    assert main(["train", "smallcnn", "--dataset", "synthetic", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cli_quiet_and_tensorboard(tmp_path, capsys):
    argv = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--max-steps",
            "2", "--quiet"]
    try:
        tensorboard_writer(str(tmp_path / "probe")).close()
    except ImportError as e:
        assert main([*argv, "--tensorboard", str(tmp_path / "tb")]) == 1
        assert "--tensorboard: TensorBoard logging needs" in capsys.readouterr().err
        pytest.skip(f"TensorBoard logging is optional: {e}")
    assert main([*argv, "--tensorboard", str(tmp_path / "tb")]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("steps: 2,")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
