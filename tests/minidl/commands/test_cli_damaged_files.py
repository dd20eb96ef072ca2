"""Damaged checkpoints and resumes that cannot continue end in one ``minidl: error:`` line
(never a traceback), before any training; a checkpoint is written with the user's usual file
mode and the run says where it went."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from minidl.interop.checkpoint import CheckpointError
from minidl.net.optim import make_optimizer
from minidl.train.trainer import Trainer
from minidl.zoo.models import get_model

from .test_cli_errors import assert_one_line_error, run

TRAIN = ["train", "smallcnn", "--dataset", "digits", "--epochs", "1", "--no-progress"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ck") / "ck.npz"
    res = run(*TRAIN, "--save", str(path))
    assert res.returncode == 0, res.stderr
    assert f"checkpoint saved to {path} (step" in res.stderr
    return str(path)


def _damaged(checkpoint: str, tmp_path, how: str) -> str:
    data = bytearray(open(checkpoint, "rb").read())
    if how == "truncated":
        data = data[:len(data) // 3]
    else:  # a flipped byte inside the parameters
        data[len(data) // 2] ^= 0xFF
    out = tmp_path / f"{how}.npz"
    out.write_bytes(bytes(data))
    return str(out)


def test_checkpoint_has_the_users_file_mode(checkpoint):
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(checkpoint).st_mode) == 0o666 & ~mask


@pytest.mark.parametrize("how", ["truncated", "flipped"])
def test_resume_of_a_damaged_checkpoint_is_one_line(checkpoint, tmp_path, how):
    bad = _damaged(checkpoint, tmp_path, how)
    res = run(*TRAIN, "--epochs", "2", "--resume", bad)
    assert_one_line_error(res, 2, f"--resume {bad}", "is damaged")


def test_compress_of_a_truncated_checkpoint_is_one_line(checkpoint, tmp_path):
    bad = _damaged(checkpoint, tmp_path, "truncated")
    res = run("compress", bad, "--model", "smallcnn", "--dataset", "digits",
              "--out", str(tmp_path / "out.mdlc"))
    assert_one_line_error(res, 2, f"checkpoint {bad} is damaged")


def test_resume_with_another_batch_size_stops_before_training(checkpoint):
    res = run(*TRAIN, "--epochs", "2", "--batch-size", "16", "--resume", checkpoint)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"minidl: error: --resume {checkpoint}: the trainer stands at")
    assert "same data and batch size" in last


def test_trainer_load_of_a_damaged_file_changes_nothing(checkpoint, tmp_path):
    net = get_model("smallcnn", input_shape=(1, 8, 8))
    trainer = Trainer(net, make_optimizer("sgd", net.parameters()))
    before = {k: v.copy() for k, v in net.state_dict().items()}
    for how in ("truncated", "flipped"):
        with pytest.raises(CheckpointError, match="is damaged"):
            trainer.load(_damaged(checkpoint, tmp_path, how), resume=True)
        after = net.state_dict()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        assert trainer.iteration == 0


@pytest.mark.parametrize("name, needle", [("out.txt", "'.txt' is not an image format"),
                                          ("out", "no extension")])
def test_plot_format_is_checked_before_training(tmp_path, name, needle):
    path = tmp_path / name
    res = run(*TRAIN, "--plot", str(path))
    assert_one_line_error(res, 2, f"--plot {path}", needle, ".png")
    assert not path.exists()
