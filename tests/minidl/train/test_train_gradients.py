"""What a PyTorch / Lightning user reaches for on ``train`` and ``fit``: gradient clipping
(``--clip-grad-norm``, ``clip_grad_norm=``), gradient accumulation
(``--accumulate-grad-batches``, ``accumulate_grad_batches=``), validation every epoch by
default when the data has a held-out split, label smoothing shown and settable, Lightning's
callback argument names (the earlier ones still taken), ``minidl.compression`` after
``import minidl``, and the expected time of a long run said once its first steps are timed."""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys

import numpy as np
import pytest

from minidl import layers
from minidl.cli import main
from minidl.datasets.data import Dataset
from minidl.net.graph import Sequential
from minidl.net.optim import SGD
from minidl.train.callbacks import (
    FitRun,
    MetricLogger,
    ModelCheckpoint,
    ProgressLogger,
    RunEstimate,
    format_duration,
)
from minidl.train.loop.fitting import History
from minidl.train.trainer import Trainer


def _net() -> Sequential:
    return Sequential([layers.Linear(4, 8), layers.ReLU(), layers.Linear(8, 3)],
                      input_shape=(4,), seed=1)


def _trainer(**kwargs) -> Trainer:
    net = _net()
    return Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9), device_memory="4MiB",
                   **kwargs)


def _data() -> Dataset:
    rng = np.random.default_rng(2)
    y = rng.integers(0, 3, 60)
    x = rng.normal(size=(60, 4)).astype(np.float32)
    x[np.arange(60), y] += 3.0
    return Dataset(x[:40], y[:40], x[40:], y[40:], 3, (4,), "toy")


def _state(tr: Trainer) -> list[np.ndarray]:
    return [p.data.copy() for p in tr.net.parameters()]


# ------------------------------------------------------------------------ accumulation
def test_two_accumulated_batches_step_like_their_union():
    d = _data()
    acc, whole = _trainer(accumulate_grad_batches=2), _trainer()
    before = _state(acc)
    acc.step(d.x_train[:8], d.y_train[:8])
    # no optimizer step after the window's first batch: the weights are untouched, bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(acc)))
    acc.step(d.x_train[8:16], d.y_train[8:16])
    whole.step(d.x_train[:16], d.y_train[:16])
    for a, b in zip(_state(acc), _state(whole)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not all(np.array_equal(a, b) for a, b in zip(before, _state(acc)))
    assert acc.iteration == 2 and acc.accumulated == 0


def test_fit_accumulates_and_an_epochs_last_window_steps_with_what_it_has():
    tr = _trainer()
    steps = []
    original = tr.optimizer.step
    tr.optimizer.step = lambda: (steps.append(tr.iteration), original())[1]
    h = tr.fit(_data(), epochs=2, batch_size=8, progress=False, accumulate_grad_batches=2)
    # 5 batches an epoch: windows of 2, 2 and 1 -> 3 optimizer steps an epoch
    assert len(h.losses) == 10 and len(steps) == 6
    assert tr.accumulate_grad_batches == 1  # (fit's setting was for that call)
    with pytest.raises(ValueError, match="accumulate_grad_batches must be a whole number >= 1"):
        tr.fit(_data(), accumulate_grad_batches=0, progress=False)


# ---------------------------------------------------------------------------- clipping
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_clipping_is_torchs_clip_grad_norm():
    import torch

    d = _data()
    free, clipped = _trainer(), _trainer(clip_grad_norm=0.05)
    free.compute_gradients(d.x_train[:16], d.y_train[:16])
    grads = [torch.from_numpy(p.grad.copy()) for p in free.net.parameters()]
    tensors = [torch.zeros(g.shape, requires_grad=True) for g in grads]
    for t, g in zip(tensors, grads):
        t.grad = g
    norm = torch.nn.utils.clip_grad_norm_(tensors, 0.05)
    assert float(norm) > 0.05  # (so the clip does something)
    clipped.step(d.x_train[:16], d.y_train[:16])
    for p, t in zip(clipped.net.parameters(), tensors):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="clip_grad_norm must be a number > 0"):
        _trainer(clip_grad_norm=-1.0)


# ---------------------------------------------------------------------------- validation
def test_fit_validates_every_epoch_when_there_is_a_held_out_split():
    h = _trainer().fit(_data(), epochs=2, batch_size=10, progress=False)
    assert h.validating and all("val_loss" in e for e in h.epochs)
    h = _trainer().fit(_data(), epochs=2, batch_size=10, progress=False, val_every=0)
    assert not h.validating and not any("val_loss" in e for e in h.epochs)
    d = _data()
    h = _trainer().fit((d.x_train, d.y_train), epochs=1, batch_size=10, progress=False)
    assert not h.validating  # (no held-out split, none given)
    # Lightning's names of epochs and val_every
    h = _trainer().fit(d, max_epochs=3, check_val_every_n_epoch=2, batch_size=10,
                       progress=False)
    assert [("val_loss" in e) for e in h.epochs] == [False, True, False]
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_epoch'"):
        _trainer().fit(d, max_epoch=3)


# ---------------------------------------------------------------------------- callbacks
def test_callbacks_take_lightnings_names_and_the_earlier_ones(tmp_path):
    new = ModelCheckpoint(tmp_path / "a-{step}.npz", every_n_train_steps=4)
    old = ModelCheckpoint(tmp_path / "b-{step}.npz", every_steps=4)
    per_epoch = ModelCheckpoint(tmp_path / "e-{epoch}.npz", every_n_epochs=2)
    log = MetricLogger(tmp_path / "log.csv", log_every_n_steps=2)
    _trainer().fit(_data(), epochs=4, batch_size=10, progress=False,
                   callbacks=[new, old, per_epoch, log])
    steps = [p.rsplit("-", 1)[1] for p in new.saved]
    assert steps == [p.rsplit("-", 1)[1] for p in old.saved] == ["4.npz", "8.npz", "12.npz",
                                                                 "16.npz"]
    assert per_epoch.saved == [str(tmp_path / "e-2.npz"), str(tmp_path / "e-4.npz")]
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert sum(r.startswith("step,") for r in rows) == 8  # steps 2, 4, ... 16
    with pytest.raises(TypeError, match="every_steps= is the earlier name of "
                                        "every_n_train_steps="):
        ModelCheckpoint(tmp_path / "x.npz", every_n_train_steps=2, every_steps=2)
    with pytest.raises(ValueError, match="every_n_train_steps=N, every_n_epochs=N or "
                                         "save_best"):
        ModelCheckpoint(tmp_path / "x.npz")
    assert ProgressLogger(io.StringIO(), log_every_n_steps=3).every_steps == 3


# ------------------------------------------------------------------------ expected time
def _run(total: int, done: int) -> FitRun:
    hist = History(start_step=0)
    hist.losses = [0.0] * done
    return FitRun(None, hist, 1, total, total, 1)


def test_a_long_run_says_its_expected_time_once_from_its_first_steps():
    est = RunEstimate()
    lines = []
    for k in range(1, 10):
        run = _run(5000, k)
        step_s = 30.0 if k == 1 else 9.4  # (the first step compiles: left out)
        lines.append(est.observe(run, {"step_time_s": step_s}))
    said = [ln for ln in lines if ln]
    assert len(said) == 1 and lines[5] == said[0], lines
    assert said[0].startswith("expected time: about 13.0 h for the 4,994 steps left "
                              "(9,400 ms a step over steps 2-6"), said[0]
    short = RunEstimate()
    assert not any(short.observe(_run(50, k), {"step_time_s": 0.1}) for k in range(1, 20))
    assert [format_duration(s) for s in (45, 190, 46800)] == ["45 s", "3.2 min", "13.0 h"]


# ----------------------------------------------------------------------- the command line
def test_train_flags_clip_accumulate_label_smoothing_and_validation(capsys):
    argv = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--epochs", "1",
            "--batch-size", "32", "--no-progress"]
    assert main([*argv, "--clip-grad-norm", "0.5", "--accumulate-grad-batches", "3",
                 "--label-smoothing", "0.2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["clip_grad_norm"], out["accumulate_grad_batches"], out["label_smoothing"]) == \
        (0.5, 3, 0.2)
    assert all("val_loss" in e for e in out["epoch_logs"])  # validated by default
    assert main([*argv, "--no-val", "--max-steps", "2", "--label-smoothing", "0.1"]) == 0
    cap = capsys.readouterr()
    assert "label smoothing 0.1" in cap.err and "val_loss" not in cap.err
    for flags, needle in [
        (["--clip-grad-norm", "0"], "--clip-grad-norm 0: give the largest global L2 norm"),
        (["--accumulate-grad-batches", "0"], "--accumulate-grad-batches 0: give the number"),
        (["--label-smoothing", "1"], "--label-smoothing 1: give a number in [0, 1)"),
        (["--no-val", "--val-every", "2"], "--no-val turns validation off"),
        (["--accumulate-grad-batches", "2", "--save", "ck.npz", "--save-every", "3"],
         "give a multiple of 2"),
    ]:
        assert main([*argv, *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_import_minidl_exposes_compression():
    code = "import minidl; print(minidl.compression.deep_compress.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "deep_compress", out.stderr


def test_one_default_batch_size_for_train_plan_and_fit(capsys):
    import inspect

    from minidl.train.loop.fitting import DEFAULT_BATCH_SIZE, fit

    assert main(["plan", "lenet5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_size"] == DEFAULT_BATCH_SIZE == 32
    assert inspect.signature(fit).parameters["batch_size"].default == DEFAULT_BATCH_SIZE
    assert inspect.signature(Trainer.fit).parameters["batch_size"].default == DEFAULT_BATCH_SIZE
    assert main(["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8",
                 "--max-steps", "1", "--json", "--no-progress", "--no-val"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch_size"] == DEFAULT_BATCH_SIZE
