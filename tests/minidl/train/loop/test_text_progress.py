"""The text models' training (``train_language_model``: fit's loop over text windows;
``minidl train char-*`` and the transformers) shows progress as ``fit`` does: a bar on a
terminal, plain lines (every N steps and after the last) without carriage returns in logs; it
resumes bit for bit and saves every N steps."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import numpy as np

from minidl import Trainer
from minidl.cli import main
from minidl.datasets.text import load_text_dataset
from minidl.net.optim import SGD
from minidl.train.loop.language_model import train_language_model
from minidl.zoo.rnn import char_rnn


def _run(steps: int, **kwargs) -> str:
    data = load_text_dataset("synthetic-text")
    net = char_rnn(data.vocab_size, 8, 16, num_layers=1, steps=8, cell="gru")
    trainer = Trainer(net, SGD(net.parameters(), lr=0.1), memory="reuse",
                      device_memory="8MiB")
    out = io.StringIO()
    res = train_language_model(trainer, data, 2, 8, steps, eval_batches=1, stream=out,
                               **kwargs)
    assert len(res["losses"]) == steps
    return out.getvalue()


def test_lines_every_n_steps_and_after_the_last_off_a_terminal():
    text = _run(5, progress_every=2)
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split(":")[0] for ln in lines[:-1]] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "(mean of the last 1)" in lines[-2]
    assert lines[-1] == "validating on 1 batches of 2 x 8 characters..."
    assert [ln.split(":")[0] for ln in _run(3).splitlines()[:-1]] == ["step 3/3"]  # default 100
    assert _run(3, progress=False) == ""


def test_long_validation_says_where_it_stands(monkeypatch):
    """Validation of a large model runs for tens of seconds after the last step: a line when
    it starts and one every few seconds (here every batch)."""
    from minidl.train.loop import language_model

    monkeypatch.setattr(language_model, "VALIDATION_LINE_S", 0.0)
    data = load_text_dataset("synthetic-text")
    net = char_rnn(data.vocab_size, 8, 16, num_layers=1, steps=8, cell="gru")
    trainer = Trainer(net, SGD(net.parameters(), lr=0.1), memory="reuse",
                      device_memory="8MiB")
    out = io.StringIO()
    train_language_model(trainer, data, 2, 8, 1, eval_batches=3, stream=out)
    lines = out.getvalue().splitlines()
    assert lines[1:] == ["validating on 3 batches of 2 x 8 characters...",
                         *[ln for ln in lines[2:] if ln.startswith("  validation batch ")]]
    assert [ln.split(",")[0] for ln in lines[2:]] == ["  validation batch 1/3",
                                                      "  validation batch 2/3"]


def _trained(steps: int, val_every: int | None, dropout: float = 0.0) -> dict:
    from minidl.zoo.transformers import TransformerConfig, gpt

    data = load_text_dataset("synthetic-text")
    net = gpt(TransformerConfig(layers=1, heads=2, dim=16, context=8, vocab=data.vocab_size,
                                dropout=dropout))
    trainer = Trainer(net, SGD(net.parameters(), lr=0.1), memory="reuse",
                      device_memory="16MiB")
    return train_language_model(trainer, data, 2, 8, steps, eval_batches=2, progress=False,
                                val_every=val_every)


def test_validation_every_n_steps_changes_no_training():
    every = _trained(4, 2, dropout=0.1)
    plain = _trained(4, None, dropout=0.1)
    assert every["losses"] == plain["losses"]  # evaluating draws no dropout mask, moves nothing
    assert every["val_loss"] == plain["val_loss"]
    assert [k for k, _ in every["val_history"]] == [2, 4]
    assert plain["val_history"] == [(4, plain["val_loss"])]
    # the loss after step 2 is what a run of 2 steps reports at its end
    assert every["val_history"][0][1] == _trained(2, None, dropout=0.1)["val_loss"]
    assert every["val_history"][0][1] != every["val_loss"]


def test_cli_validation_every_n_steps(capsys):
    import json

    assert main(["train", "char-gru", "--dataset", "synthetic", "--batch-size", "4", "--seq-len",
                 "16", "--width", "32", "--max-steps", "4", "--val-every", "2", "--log-every",
                 "2", "--json"]) == 0
    out = capsys.readouterr()
    assert "step 2/4: validation loss " in out.err
    res = json.loads(out.out)
    assert [k for k, _ in res["val_history"]] == [2, 4]
    assert res["val_history"][-1][1] == res["val_loss"]


def test_a_bar_on_a_terminal():
    assert "\r" in _run(3, interactive=True)


def test_cli_without_a_terminal_writes_lines():
    env = {**os.environ, "MINIDL_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "minidl", "train", "char-gru", "--dataset",
                        "synthetic", "--max-steps", "5", "--log-every", "2", "--batch-size",
                        "4", "--seq-len", "16", "--width", "32"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr
    steps = [ln.split(":")[0] for ln in p.stderr.splitlines() if ln.startswith("step ")]
    assert steps == ["step 2/5", "step 4/5", "step 5/5"]
    assert "validation loss" in p.stdout


def _cli(tmp_path, *argv):
    base = ["train", "char-gru", "--dataset", "synthetic", "--batch-size", "4", "--seq-len",
            "16", "--width", "32", "--memory", "reuse", "--quiet"]
    return main([*base, *argv])


def test_resume_continues_bit_for_bit(tmp_path, capsys):
    whole, part = tmp_path / "whole.npz", tmp_path / "part.npz"
    assert _cli(tmp_path, "--max-steps", "6", "--save", str(whole)) == 0
    assert _cli(tmp_path, "--max-steps", "3", "--save", str(part)) == 0
    assert _cli(tmp_path, "--max-steps", "6", "--save", str(part), "--resume", str(part)) == 0
    a, b = np.load(whole), np.load(part)
    assert int(b["trainer/iteration"]) == 6
    names = [k for k in a.files if k.startswith(("param/", "optim/"))]
    assert names and all(np.array_equal(a[k], b[k]) for k in names)
    capsys.readouterr()
    assert _cli(tmp_path, "--max-steps", "6", "--resume", str(part)) == 2
    assert "already at step 6" in capsys.readouterr().err


def test_save_every(tmp_path, monkeypatch):
    saved = []
    real_save = Trainer.save
    monkeypatch.setattr(Trainer, "save",
                        lambda self, path: (saved.append(self.iteration), real_save(self, path)))
    ck = tmp_path / "ck.npz"
    assert _cli(tmp_path, "--max-steps", "5", "--save-every", "2", "--save", str(ck)) == 0
    assert saved == [2, 4, 5]  # every 2 steps, and at the end
    assert _cli(tmp_path, "--max-steps", "3", "--log", str(tmp_path / "m.csv")) == 2
