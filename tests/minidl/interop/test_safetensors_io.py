"""minidl.interop.safetensors_io and ``minidl train --save FILE.safetensors`` / ``--init-from``:
bit-for-
bit round trips (CNN, BatchNorm buffers, GPT with a tied head), strict one-line errors, atomic
writes, the missing extra, the CLI end to end, and PyTorch twins loading the files strictly."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl.interop.safetensors_io import (
    IncompatibleKeys,
    SafetensorsError,
    load_into,
    load_safetensors,
    save_safetensors,
    torch_state_names,
)
from minidl.net.optim import SGD
from minidl.zoo.models import get_model, smallcnn
from minidl.zoo.transformers import TransformerConfig, gpt

stn = pytest.importorskip("safetensors.numpy")

GPT = TransformerConfig(layers=2, heads=2, dim=16, context=6, vocab=13, dropout=0.0)
NETS = {
    "smallcnn": lambda seed: _seeded(lambda: smallcnn((1, 8, 8), 10, width=4), seed),
    "resnet8": lambda seed: _seeded(lambda: get_model("resnet8", (3, 8, 8), 10), seed),
    "gpt": lambda seed: gpt(GPT, seed=seed),
}


def _seeded(build, seed: int):
    """``build()`` with every parameter and buffer drawn from ``seed`` (BatchNorm's counters
    and running statistics too), so that two seeds differ everywhere."""
    net = build()
    rng = np.random.default_rng(seed)
    for _, p in net.named_parameters(True):
        if p.dtype.kind == "i":
            p.data[...] = rng.integers(1, 100, p.shape)
        else:
            p.data[...] = rng.standard_normal(p.shape).astype(p.dtype)
    return net


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()
        for k in a)


@pytest.mark.parametrize("model", list(NETS))
@pytest.mark.parametrize("torch_names", [False, True])
def test_round_trip_is_bit_for_bit(tmp_path, model, torch_names):
    src, dst = NETS[model](1), NETS[model](2)
    assert not _same_bits(src.state_dict(), dst.state_dict())
    path = tmp_path / "w.safetensors"
    save_safetensors(src, path, torch_names=torch_names)
    if not torch_names:
        assert _same_bits(load_safetensors(path), src.state_dict())
    assert load_into(dst, path) == IncompatibleKeys([], [])
    assert _same_bits(dst.state_dict(), src.state_dict())


def test_zero_dim_buffers_stay_zero_dim_and_metadata_is_kept(tmp_path):
    net = NETS["resnet8"](1)
    path = tmp_path / "w.safetensors"
    save_safetensors(net, path, metadata={"note": "hello"})
    assert load_safetensors(path)["bn1.num_batches_tracked"].shape == ()
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "pt", "minidl.names": "minidl", "note": "hello"}


def test_a_state_dict_saves_too_and_gpt_names_its_tied_weight_twice(tmp_path):
    net = gpt(GPT)
    path = tmp_path / "w.safetensors"
    save_safetensors({"a": np.arange(6).reshape(2, 3)[:, ::2]}, path)  # not contiguous
    assert load_safetensors(path)["a"].tolist() == [[0, 2], [3, 5]]
    names = torch_state_names(net)
    assert names["transformer.wte.weight"] == ["mods.transformer_wte.weight",
                                               "mods.lm_head.weight"]
    save_safetensors(net, path, torch_names=True)
    assert len(load_safetensors(path)) == len(net.state_dict()) + 1


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises((SafetensorsError, TypeError, FileNotFoundError)) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_strict_errors_name_the_key_and_shapes_and_change_nothing(tmp_path):
    net = NETS["smallcnn"](1)
    before = net.state_dict()
    path = tmp_path / "w.safetensors"
    state = NETS["smallcnn"](2).state_dict()

    save_safetensors({k: v for k, v in state.items() if k != "fc.bias"}, path)
    assert _error(load_into, net, path).endswith("does not match smallcnn: missing fc.bias")
    assert load_into(net, path, strict=False) == IncompatibleKeys(["fc.bias"], [])
    assert net.state_dict()["fc.weight"].tobytes() == state["fc.weight"].tobytes()
    net.load_state_dict(before)

    save_safetensors({**state, "extra.weight": np.zeros(2)}, path)
    assert _error(load_into, net, path).endswith("unexpected extra.weight")
    assert load_into(net, path, strict=False).unexpected_keys == ["extra.weight"]
    net.load_state_dict(before)

    save_safetensors({**state, "conv1.weight": np.zeros((4, 1, 5, 5), np.float32)}, path)
    assert _error(load_into, net, path) == (f"{path}: conv1.weight has shape (4, 1, 5, 5) in "
                                            "the file, (4, 1, 3, 3) in smallcnn")
    save_safetensors({**state, "fc.bias": np.ones(10, bool)}, path)
    load_into(net, path)  # bool -> float is a safe cast
    net.load_state_dict(before)

    bn = NETS["resnet8"](1)
    bstate = bn.state_dict()
    save_safetensors({**bstate, "bn1.num_batches_tracked": np.array(1.5)}, path)
    assert "bn1.num_batches_tracked is float64 in the file, int64 in resnet8" in _error(
        load_into, bn, path)
    assert _same_bits(bn.state_dict(), bstate)
    assert _same_bits(net.state_dict(), before)


def test_tied_weights_that_differ_in_a_torch_named_file_are_refused(tmp_path):
    net = gpt(GPT)
    path = tmp_path / "w.safetensors"
    save_safetensors(net, path, torch_names=True)
    state = load_safetensors(path)
    state["mods.lm_head.weight"] = state["mods.lm_head.weight"] + 1
    save_safetensors(state, path)
    msg = _error(load_into, net, path)
    assert "are one tied weight (transformer.wte.weight) of gpt but differ" in msg
    assert "mods.transformer_wte.weight" in msg and "mods.lm_head.weight" in msg


def test_bad_files_are_one_line_errors(tmp_path):
    net = NETS["smallcnn"](1)
    text, npz, empty, cut = (tmp_path / n for n in ("a.txt", "b.npz", "c.st", "d.st"))
    text.write_text("hello\n")
    np.savez(npz, a=np.zeros(3))
    empty.write_bytes(b"")
    save_safetensors(net, cut)
    cut.write_bytes(cut.read_bytes()[:-7])
    assert "is a text file, not a safetensors file" in _error(load_safetensors, text)
    assert "is a zip / .npz file" in _error(load_into, net, npz)
    assert "is an empty file, not a safetensors file" in _error(load_safetensors, empty)
    assert "not a safetensors file" in _error(load_safetensors, cut)
    assert "does not exist" in _error(load_safetensors, tmp_path / "missing.safetensors")
    assert "dtype object cannot be stored" in _error(
        save_safetensors, {"a": np.array([None])}, tmp_path / "o.safetensors")
    assert "metadata is text only" in _error(save_safetensors, net, tmp_path / "o.safetensors",
                                             metadata={"step": 3})
    assert "needs the network" in _error(save_safetensors, {}, tmp_path / "o.safetensors",
                                         torch_names=True)
    assert "folder" in _error(save_safetensors, net, tmp_path / "no" / "w.safetensors")


def test_write_is_atomic(tmp_path, monkeypatch):
    net = NETS["smallcnn"](1)
    path = tmp_path / "w.safetensors"
    save_safetensors(net, path)
    good = path.read_bytes()

    def broken(arrays, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(stn, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_safetensors(NETS["smallcnn"](2), path)
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["w.safetensors"]


def test_missing_extra_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'minidl\[io\]'"):
        save_safetensors(NETS["smallcnn"](1), tmp_path / "w.safetensors")
    from minidl.cli import main

    assert main(["train", "smallcnn", "--dataset", "synthetic", "--max-steps", "1",
                 "--save", str(tmp_path / "w.safetensors")]) == 1
    assert not (tmp_path / "w.safetensors").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MINIDL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minidl", "train", "smallcnn", "--dataset",
                           "synthetic", "--input", "1x8x8", "--batch-size", "8", "--json",
                           "--max-steps", "2", "--seed", "1", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_cli_saves_the_weights_and_starts_from_them(tmp_path):
    ck, st, again = tmp_path / "ck.npz", tmp_path / "w.safetensors", tmp_path / "b.safetensors"
    for path in (ck, st):
        res = _cli("--save", str(path))
        assert res.returncode == 0, res.stderr
    with np.load(ck) as z:  # the same 2 steps: the same weights as the .npz checkpoint's
        trained = {k[6:]: z[k] for k in z.files if k.startswith("param/")}
    assert _same_bits(load_safetensors(st), trained)
    net = smallcnn((1, 8, 8), 10)
    load_into(net, st)
    assert _same_bits(net.state_dict(), trained)
    # a step at a vanishing learning rate from --init-from leaves those weights as they were
    res = _cli("--init-from", str(st), "--lr", "1e-30", "--max-steps", "1", "--save", str(again))
    assert res.returncode == 0, res.stderr
    fresh = _cli("--max-steps", "1")
    assert json.loads(res.stdout)["losses"] != json.loads(fresh.stdout)["losses"]
    for k, v in load_safetensors(again).items():
        np.testing.assert_allclose(v, trained[k], rtol=0, atol=1e-20, err_msg=k)


@pytest.mark.parametrize("args, message", [
    (("--save", "{d}/w.safetensors", "--save-every", "1"), "--save-every N writes resumable"),
    (("--resume", "{d}/w.safetensors"), "holds the weights only"),
    (("--init-from", "{d}/w.safetensors", "--resume", "{d}/ck.npz"), "give only one of them"),
    (("--init-from", "{d}/missing.safetensors"), "--init-from {d}/missing.safetensors: no such"),
    (("--init-from", "{d}/ck.npz"), "is a zip / .npz file"),
    (("--init-from", "{d}/w.safetensors", "--input", "3x8x8"),
     "conv1.weight has shape (32, 1, 3, 3) in the file, (32, 3, 3, 3) in smallcnn"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    from minidl.cli import main

    save_safetensors(smallcnn((1, 8, 8), 10), tmp_path / "w.safetensors")
    np.savez(tmp_path / "ck.npz", a=np.zeros(1))
    argv = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--max-steps",
            "1", *(a.format(d=tmp_path) for a in args)]
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        assert main(argv) == 2
    out = buf.getvalue().strip()
    assert out.startswith("minidl: error: ") and "\n" not in out
    assert message.format(d=tmp_path) in out


@pytest.mark.parametrize("model", ["smallcnn", "resnet8", "gpt"])
def test_the_pytorch_twin_loads_the_file_strictly_with_the_same_logits(tmp_path, model):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from minidl.interop.torch_bridge import to_torch

    net, other = NETS[model](1), NETS[model](2)
    if model == "resnet8":  # running statistics that keep eval-mode activations in range
        for name, p in list(net.named_parameters(True)) + list(other.named_parameters(True)):
            if name.endswith("running_var"):
                p.data[...] = np.abs(p.data) + 0.5
    path = tmp_path / "w.safetensors"
    save_safetensors(net, path, torch_names=True)
    twin = to_torch(other).eval()  # another model's weights until the file is loaded
    rng = np.random.default_rng(0)
    x = (rng.integers(0, GPT.vocab, (3, GPT.context)) if model == "gpt"
         else rng.standard_normal((3, *net.input_shapes[0])).astype(np.float32))
    ours = minidl.Trainer(net, SGD(net.parameters(), lr=0.0), device_memory="16MiB").predict(x)
    with torch.no_grad():
        before = twin(torch.from_numpy(x)).numpy()
        twin.load_state_dict(st.load_file(str(path)), strict=True)
        theirs = twin(torch.from_numpy(x)).numpy()
    assert not np.allclose(before, ours, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)
