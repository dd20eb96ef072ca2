"""Resuming: training 20 steps equals training 10, saving, resuming in a fresh trainer and
training 10 more, bit for bit (parameters and losses), through the API and ``minidl train``."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidl import Sequential, Trainer, layers
from minidl.datasets.data import Dataset, random_shift
from minidl.net.optim import SGD, Adam, CosineAnnealingLR, StepLR
from minidl.train.callbacks import ModelCheckpoint
from minidl.train.trainer import CheckpointError


def _data() -> Dataset:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(44, 1, 6, 6)).astype(np.float32)
    y = rng.integers(0, 3, 44)
    return Dataset(x[:36], y[:36], x[36:], y[36:], 3, (1, 6, 6), "toy")  # 36 / 8: 5 batches


def _trainer(optimizer: str, schedule: str | None) -> Trainer:
    net = Sequential([layers.Conv2d(1, 4, 3, padding=1), layers.ReLU(), layers.Flatten(),
                      layers.Dropout(0.3), layers.Linear(144, 3)], input_shape=(1, 6, 6))
    opt = (SGD(net.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else Adam(net.parameters(), lr=1e-2))
    sched = {"cosine": lambda: CosineAnnealingLR(opt, T_max=4),
             "step": lambda: StepLR(opt, step_size=1, gamma=0.5), None: lambda: None}[schedule]()
    return Trainer(net, opt, memory="reuse,inplace", device_memory="16MiB", scheduler=sched,
                   seed=3)


def _fit(tr: Trainer, steps: int, **kw):
    return tr.fit(_data(), epochs=4, batch_size=8, max_steps=steps, progress=False,
                  evaluate=False, augment=lambda x, rng: random_shift(x, rng, probability=0.5),
                  **kw)


@pytest.mark.parametrize("optimizer,schedule,stop", [
    ("sgd", "cosine", 7),    # mid-epoch: after the second batch of the second epoch
    ("adam", "step", 12),
    ("sgd", None, 15),       # at an epoch's end
])
def test_resume_is_bit_identical(tmp_path, optimizer, schedule, stop):
    whole = _trainer(optimizer, schedule)
    h_whole = _fit(whole, 20)
    first = _trainer(optimizer, schedule)
    h_first = _fit(first, stop)
    first.save(tmp_path / "ck.npz")
    second = _trainer(optimizer, schedule)
    second.load(tmp_path / "ck.npz", resume=True)
    assert (second.fit_state.epoch, second.fit_state.epoch_step) == (
        first.fit_state.epoch, first.fit_state.epoch_step)
    h_second = _fit(second, 20)
    assert h_first.losses + h_second.losses == h_whole.losses
    assert second.optimizer.lr == whole.optimizer.lr
    for (k, a), b in zip(whole.net.state_dict().items(), second.net.state_dict().values()):
        assert np.array_equal(a, b), k
    for k, a in whole.optimizer.state_dict().items():
        assert np.array_equal(a, second.optimizer.state_dict()[k]), k


def test_checkpoint_every_n_steps_resumes_exactly(tmp_path):
    whole = _trainer("sgd", "cosine")
    h_whole = _fit(whole, 20)
    interrupted = _trainer("sgd", "cosine")
    ck = ModelCheckpoint(tmp_path / "every.npz", every_steps=7)
    _fit(interrupted, 14, callbacks=[ck])  # ... as if killed after step 14's checkpoint
    assert ck.saved == [str(tmp_path / "every.npz")] * 2
    resumed = _trainer("sgd", "cosine")
    resumed.load(tmp_path / "every.npz", resume=True)
    assert resumed.iteration == 14
    h = _fit(resumed, 20)
    assert h.losses == h_whole.losses[14:]
    assert all(np.array_equal(a, b) for a, b in zip(whole.net.state_dict().values(),
                                                    resumed.net.state_dict().values()))


def test_resume_errors_name_the_problem(tmp_path):
    tr = _trainer("sgd", "cosine")
    _fit(tr, 3)
    tr.save(tmp_path / "ck.npz")
    plain = _trainer("sgd", None)
    with pytest.raises(CheckpointError, match="scheduler"):
        plain.load(tmp_path / "ck.npz", resume=True)
    plain.load(tmp_path / "ck.npz")  # the weights alone: a new run from them
    assert plain.fit_state.epoch == 0 and plain.iteration == 3
    other = _trainer("sgd", "cosine")
    other.load(tmp_path / "ck.npz", resume=True)
    with pytest.raises(ValueError, match="same data and batch size"):
        other.fit(_data(), epochs=4, batch_size=4, progress=False)


def test_fit_continues_from_where_it_stood():
    tr = _trainer("sgd", "step")
    assert len(tr.fit(_data(), epochs=1, batch_size=8, progress=False).losses) == 5
    h = tr.fit(_data(), epochs=3, batch_size=8, progress=False)
    assert len(h.losses) == 10 and [e["epoch"] for e in h.epochs] == [1, 2]
    assert tr.optimizer.lr == pytest.approx(0.05 * 0.5 ** 3)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIDL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minidl", "train", "smallcnn", "--dataset",
                           "synthetic", "--input", "1x8x8", "--batch-size", "8", "--epochs", "2",
                           "--json", "--seed", "1", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_cli_resume_continues_the_run(tmp_path):
    whole = _cli("--max-steps", "12")
    assert whole.returncode == 0, whole.stderr
    ck = tmp_path / "ck.npz"
    part = _cli("--max-steps", "7", "--save", str(ck), "--save-every", "3")
    assert part.returncode == 0, part.stderr
    rest = _cli("--max-steps", "12", "--resume", str(ck))
    assert rest.returncode == 0, rest.stderr
    losses = json.loads(whole.stdout)["losses"]
    assert json.loads(part.stdout)["losses"] + json.loads(rest.stdout)["losses"] == losses
    bad = _cli("--resume", str(tmp_path / "missing.npz"))
    assert bad.returncode == 2 and bad.stderr.startswith("minidl: error: --resume")


def _early(patience: int = 2):
    from minidl.train.callbacks import EarlyStopping

    return EarlyStopping("val_loss", patience=patience, min_delta=0.2)


@pytest.mark.parametrize("stop", [6, 10])
def test_resume_continues_early_stopping_bit_for_bit(tmp_path, stop):
    """Early stopping's state (best value, epochs waited) is in the checkpoint: an interrupted
    run resumed stops at the same epoch with the same weights as the uninterrupted run, and a
    run resumed after it stopped early trains nothing."""
    kw = dict(epochs=12, batch_size=8, progress=False, evaluate=False, val_every=1)
    whole = _trainer("sgd", None)
    h_whole = whole.fit(_data(), callbacks=[_early()], **kw)
    assert h_whole.stopping.early and len(h_whole.epochs) < 12
    first = _trainer("sgd", None)
    first.fit(_data(), callbacks=[_early()], max_steps=stop, **kw)
    first.save(tmp_path / "ck.npz")
    second = _trainer("sgd", None)
    second.load(tmp_path / "ck.npz", resume=True)
    h_second = second.fit(_data(), callbacks=[_early()], **kw)
    assert h_second.stopping.early and h_second.stopping.reason == h_whole.stopping.reason
    assert second.iteration == whole.iteration
    for (name, a), b in zip(whole.net.state_dict().items(), second.net.state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    whole.save(tmp_path / "done.npz")
    third = _trainer("sgd", None)
    third.load(tmp_path / "done.npz", resume=True)
    h_third = third.fit(_data(), callbacks=[_early()], **kw)
    assert h_third.losses == [] and h_third.stopping.early
    assert third.iteration == whole.iteration


def test_cli_early_stop_said_once_logged_with_peaks_and_resumed(tmp_path):
    """The daily-tools flags: 'early stopping' printed once, the CSV's peak_bytes filled on
    every row, --save-every past the run's end said so, and a resume after the early stop
    trains nothing."""
    log, ck = tmp_path / "run.csv", tmp_path / "ck.npz"
    flags = ("train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--batch-size",
             "8", "--epochs", "30", "--seed", "1", "--val-every", "1", "--early-stopping", "1",
             "--log", str(log), "--save", str(ck), "--save-every", "100000")
    env = {**os.environ, "MINIDL_NUM_THREADS": "1"}
    first = subprocess.run([sys.executable, "-m", "minidl", *flags], capture_output=True,
                           text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    said = first.stdout + first.stderr
    assert said.count("early stopping:") == 1, said
    assert "--save-every 100000 is past this run's last step" in first.stderr
    with open(log, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(int(r["peak_bytes"]) > 0 for r in rows)
    again = subprocess.run([sys.executable, "-m", "minidl", *flags, "--resume", str(ck)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "nothing to train: the run had stopped early" in again.stdout
    with open(log, newline="") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_an_epoch_cut_by_a_resume_logs_all_its_steps(tmp_path):
    """The epoch a resume cuts in the middle logs its mean loss and accuracy over all its
    steps (the ones before the interruption are in the checkpoint), as the whole run does."""
    whole = _trainer("sgd", None)
    h_whole = _fit(whole, 15)
    first = _trainer("sgd", None)
    _fit(first, 7)  # the second batch of the second epoch
    first.save(tmp_path / "ck.npz")
    second = _trainer("sgd", None)
    second.load(tmp_path / "ck.npz", resume=True)
    h_second = _fit(second, 15)
    assert [e["epoch"] for e in h_second.epochs] == [1, 2]
    for a, b in zip(h_second.epochs, h_whole.epochs[1:]):
        assert (a["loss"], a["accuracy"]) == (b["loss"], b["accuracy"])
