"""The text models' training loop (``rnn.train_language_model``, ``minidl train char-*`` and
the transformers) shows progress as ``fit`` does: a bar on a terminal, plain lines (every N
steps and after the last) without carriage returns in logs."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from minidl import Trainer
from minidl.optim import SGD
from minidl.rnn import char_rnn, train_language_model
from minidl.text import load_text_dataset


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
    assert [ln.split(":")[0] for ln in text.splitlines()] == ["step 2/5", "step 4/5",
                                                                "step 5/5"]
    assert "(mean of the last 1)" in text.splitlines()[-1]
    assert [ln.split(":")[0] for ln in _run(3).splitlines()] == ["step 3/3"]  # default: 100
    assert _run(3, progress=False) == ""


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
