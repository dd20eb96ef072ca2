"""``minidl compress`` end to end on a small LeNet-5 (digits), ``minidl plan --inference
--compressed`` against a real run, and the commands' one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minidl import Trainer
from minidl.cli import main
from minidl.compression import CompressedRunner, read
from minidl.datasets import data as D
from minidl.zoo.models import get_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ds = D.load_dataset("digits")
    ds.standardize()
    net = get_model("lenet5", input_shape=ds.input_shape, num_classes=10)
    t = Trainer(net, device_memory="32MiB")
    t.fit(ds, epochs=1, batch_size=64, progress=False, evaluate=False)
    path = tmp_path_factory.mktemp("ckpt") / "lenet5.npz"
    t.save(path)
    t.close()
    return path


def test_compress_then_plan_from_the_file(checkpoint, tmp_path, capsys):
    out = tmp_path / "lenet5.mdc"
    code = main(["compress", str(checkpoint), "--model", "lenet5", "--dataset", "digits",
                 "--prune", "0.6,conv1=0.2", "--bits", "conv=6,fc=4", "--index-bits", "3",
                 "--rounds", "2", "--retrain-steps", "3", "--out", str(out), "--json"])
    assert code == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["file_bytes"] == out.stat().st_size and rep["predictions_match"] is True
    assert rep["ratio"] > 4
    assert {"baseline", "pruned", "quantized", "fine-tuned",
            "huffman (from the file)"} <= set(rep["accuracy"])
    layers = {r["param"]: r for r in rep["layers"]}
    assert layers["conv1.weight"]["kept_fraction"] == pytest.approx(0.8, abs=0.01)
    assert layers["fc1.weight"]["kept_fraction"] == pytest.approx(0.4, abs=0.01)
    assert layers["fc1.weight"]["codebook"] <= 15 and layers["conv2.weight"]["value_bits"] == 6
    assert rep["stage_bytes"]["dense"] > rep["stage_bytes"]["pruned"] \
        > rep["stage_bytes"]["quantized"] > rep["stage_bytes"]["huffman"]

    assert main(["plan", "--inference", "--compressed", str(out), "--batch-size", "2",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    runner = CompressedRunner(read(out))
    runner.run_batch(np.zeros((2, 1, 8, 8), np.float32))
    assert runner.pool.stats()["allocated_bytes.peak"] == planned["peak_allocated_bytes"]
    assert main(["plan", "--inference", "--compressed", str(out)]) == 0
    assert "the dense float32 weights alone" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--prune", "1.5"], "--prune '1.5': bad value '1.5'"),
    (["--bits", "conv=8,dense=3"], "unknown layer or kind 'dense'"),
    (["--bits", "conv=8"], "gives no value for fc1, fc2, fc3"),
    (["--model", "smallcnn"], "does not match smallcnn"),
    (["--dataset", "cifar"], "unknown dataset 'cifar'"),
])
def test_compress_errors_are_one_line(checkpoint, tmp_path, capsys, argv, message):
    base = ["compress", str(checkpoint), "--model", "lenet5", "--dataset", "digits",
            "--out", str(tmp_path / "x.mdc"), "--retrain-steps", "0", "--rounds", "1"]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("minidl: error:")
    assert not (tmp_path / "x.mdc").exists()


def test_plan_rejects_broken_files(checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.mdc"
    bad.write_bytes(b"MINIDLDC" + bytes(30))
    assert main(["plan", "--inference", "--compressed", str(bad)]) == 2
    assert main(["plan", "--inference", "--compressed", str(checkpoint)]) == 2
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("minidl: error:") for line in err)
    assert "not a minidl compressed model" in err[1] and "needs a MODEL" in err[2]
