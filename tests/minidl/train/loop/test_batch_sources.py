"""fit runs image epochs and text windows alike (minidl/train/loop/batch_sources.py): the text
models' training is fit over TextWindows."""

from __future__ import annotations

import numpy as np

from minidl import Trainer
from minidl.datasets.text import load_text_dataset
from minidl.net.optim import SGD, StepLR
from minidl.train.callbacks import Callback
from minidl.train.loop.batch_sources import ImageEpochs, TextWindows
from minidl.train.loop.fitting import fit
from minidl.train.loop.language_model import train_language_model
from minidl.zoo.rnn import char_rnn


class _Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.epochs = 0

    def on_step_end(self, run, logs) -> None:
        self.steps.append(run.trainer.fit_state.epoch_step)

    def on_epoch_end(self, run, logs) -> None:
        self.epochs += 1


def _trainer(scheduler=None):
    data = load_text_dataset("synthetic-text")
    net = char_rnn(data.vocab_size, 8, 16, num_layers=1, steps=8, cell="gru")
    opt = SGD(net.parameters(), lr=0.1)
    return data, Trainer(net, opt, memory="reuse", device_memory="8MiB",
                         scheduler=scheduler(opt) if scheduler else None)


def test_text_windows_are_fixed_by_the_seed_whatever_the_length():
    tokens = load_text_dataset("synthetic-text").train
    short = list(TextWindows(tokens, 2, 8, 3, seed=5).batches(None, 0, 0))
    long = list(TextWindows(tokens, 2, 8, 6, seed=5).batches(None, 0, 0))
    assert len(short) == 3 and len(long) == 6
    for (xa, ya), (xb, yb) in zip(short, long):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    tail = list(TextWindows(tokens, 2, 8, 6, seed=5).batches(None, 0, 4))
    assert len(tail) == 2 and np.array_equal(tail[0][0], long[4][0])


def test_image_epochs_count_their_batches():
    x, y = np.zeros((10, 1, 4, 4), np.float32), np.zeros(10, np.int64)
    assert ImageEpochs(x, y, 4).steps_per_epoch == 3


def test_fit_over_text_windows_is_the_text_models_training():
    data, a = _trainer()
    res = train_language_model(a, data, 2, 8, 4, eval_batches=1, progress=False)
    data, b = _trainer()
    seen = _Steps()
    hist = fit(b, TextWindows(data.train, 2, 8, 4), epochs=1, batch_size=2, progress=False,
               evaluate=False, callbacks=[seen])
    assert hist.losses == res["losses"]  # one loop: the same steps, bit for bit
    assert seen.steps == [1, 2, 3, 4] and seen.epochs == 1
    assert all(np.isnan(hist.train_accuracy))  # no logits fetched for an accuracy
    assert b.iteration == 4


def test_a_text_run_continues_from_the_trainers_iteration():
    data, a = _trainer()
    whole = train_language_model(a, data, 2, 8, 5, eval_batches=1, progress=False)
    data, b = _trainer()
    first = train_language_model(b, data, 2, 8, 2, eval_batches=1, progress=False)
    rest = train_language_model(b, data, 2, 8, 5, eval_batches=1, progress=False)
    assert first["losses"] + rest["losses"] == whole["losses"]


def test_a_text_run_leaves_the_learning_rate_schedule_alone():
    data, tr = _trainer(lambda opt: StepLR(opt, step_size=1, gamma=0.5))
    train_language_model(tr, data, 2, 8, 3, eval_batches=1, progress=False)
    assert tr.optimizer.lr == 0.1
