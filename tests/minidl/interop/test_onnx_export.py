"""ONNX export (minidl.interop.onnx_export, ``minidl export``): onnxruntime's outputs on each
exported
file equal minidl's own eval-mode outputs (``Trainer.predict``) within 1e-5 for CNNs (with
BatchNorm), the char RNNs (fused and unrolled, LSTM and GRU) and small transformers, at other
batch sizes (and, where the graph allows, sequence lengths) than the export's; the command
line works from a checkpoint and fails in one line, exit 2, on bad input. Skipped without
onnx and onnxruntime (``pip install 'minidl[onnx]' onnxruntime``)."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import minidl.layers as L  # noqa: E402
from minidl import cli  # noqa: E402
from minidl.commands import export as export_cmd  # noqa: E402
from minidl.commands.export import add_parser  # noqa: E402
from minidl.interop.onnx_export import (  # noqa: E402
    SUPPORTED_LAYERS,
    OnnxExportError,
    export_onnx,
    run_onnx,
)
from minidl.net.graph import Input, Network  # noqa: E402
from minidl.train.trainer import Trainer  # noqa: E402
from minidl.zoo.models import get_model  # noqa: E402
from minidl.zoo.rnn import char_rnn  # noqa: E402
from minidl.zoo.transformers import TransformerConfig, bert, gpt  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-5}


def trained(net: Network, x: np.ndarray, y: np.ndarray, steps: int = 2) -> Trainer:
    """A trainer whose network has taken ``steps`` SGD steps (BatchNorm's running statistics
    and the weights moved off their initial values)."""
    t = Trainer(net, seed=0)
    for _ in range(steps):
        t.step(x, y)
    return t


def assert_same(trainer: Trainer, path, x: np.ndarray) -> np.ndarray:
    got = run_onnx(path, x)[0]
    ref = trainer.predict(x)
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, **TOL)
    return got


# --------------------------------------------------------------------------- the models
CNNS = [("smallcnn", (1, 12, 12), {"width": 4}), ("lenet5", (1, 28, 28), {}),
        ("resnet20", (3, 8, 8), {"width": 4}), ("vgg11_bn", (3, 8, 8), {"width": 8}),
        ("alexnet", (3, 16, 16), {"width": 4})]


@pytest.mark.parametrize("name,shape,kw", CNNS, ids=[c[0] for c in CNNS])
def test_cnn_matches_minidl(name, shape, kw, tmp_path):
    rng = np.random.default_rng(0)
    net = get_model(name, shape, 5, **kw)
    x = rng.standard_normal((4, *shape)).astype(np.float32)
    t = trained(net, x, rng.integers(0, 5, 4))
    path = tmp_path / f"{name}.onnx"
    model = export_onnx(net, path, shape)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    for batch in (3, 1):  # the batch dimension is dynamic
        assert_same(t, path, rng.standard_normal((batch, *shape)).astype(np.float32))
    ops = {n.op_type for n in model.graph.node}
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    if name != "resnet20":
        assert dims == ["batch", *shape]
        return
    assert {"BatchNormalization", "GlobalAveragePool", "Add"} <= ops
    # global pooling before the classifier: the file takes other image sizes too
    assert dims == ["batch", 3, "height", "width"]
    other = get_model(name, (3, 12, 12), 5, **kw)
    other.load_state_dict(net.state_dict())
    assert_same(Trainer(other), path, rng.standard_normal((2, 3, 12, 12)).astype(np.float32))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unrolled"])
def test_char_rnn_matches_minidl(cell, fused, tmp_path):
    rng = np.random.default_rng(1)
    net = char_rnn(11, 8, 8, 2, steps=5, cell=cell, fused=fused)
    x = rng.integers(0, 11, (3, 5))
    t = trained(net, x, rng.integers(0, 11, (3, 5)))
    path = tmp_path / "rnn.onnx"
    model = export_onnx(net, path, (5,))
    assert_same(t, path, rng.integers(0, 11, (2, 5)))
    ops = {n.op_type for n in model.graph.node}
    if fused:  # ONNX's own LSTM / GRU ops, and the sequence length is dynamic too
        assert cell.upper() in ops
        assert_same(t, path, rng.integers(0, 11, (2, 9)))
    else:
        assert "LSTM" not in ops and "GRU" not in ops


@pytest.mark.parametrize("gelu,opset", [("none", 17), ("tanh", 17), ("none", 20)])
def test_gpt_matches_minidl(gelu, opset, tmp_path):
    rng = np.random.default_rng(2)
    net = gpt(TransformerConfig(2, 2, 16, 8, 13, gelu=gelu))
    x = rng.integers(0, 13, (3, 8))
    t = trained(net, x, rng.integers(0, 13, (3, 8)))
    path = tmp_path / "gpt.onnx"
    model = export_onnx(net, path, opset=opset)
    got = assert_same(t, path, rng.integers(0, 13, (2, 8)))
    assert got.shape == (2, 8, 13)
    ops = {n.op_type for n in model.graph.node}
    assert {"Gather", "LayerNormalization", "Softmax", "Trilu", "Where"} <= ops
    assert ("Gelu" in ops) == (opset >= 20)
    # the tied lm_head weight is one initializer
    assert sum(i.name == "transformer.wte.weight" for i in model.graph.initializer) == 1
    # a shorter sequence: causal, so the first 5 positions of the full one
    x = rng.integers(0, 13, (2, 8))
    np.testing.assert_allclose(run_onnx(path, x[:, :5])[0], t.predict(x)[:, :5], **TOL)


def test_bert_matches_minidl(tmp_path):
    rng = np.random.default_rng(3)
    net = bert(TransformerConfig(1, 2, 16, 6, 13))
    path = tmp_path / "bert.onnx"
    export_onnx(net, path)
    assert_same(Trainer(net), path, rng.integers(0, 13, (2, 6)))


def test_other_layers_and_heads(tmp_path):
    """Layers the reference models leave out: strided / dilated / bias-free convolutions,
    BatchNorm without affine and over (N, C, L), LeakyReLU, Sigmoid, Tanh, AvgPool with
    padding, Concat, partial Flattens, a Linear on (N, C, L), Dropout; softmax and log-softmax
    heads."""
    rng = np.random.default_rng(4)
    x = Input((3, 9, 9))
    a = L.LeakyReLU(0.1)(L.BatchNorm2d(4, affine=False)(
        L.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2)(x)))
    b = L.Sigmoid()(L.Conv2d(3, 4, 1, bias=False)(L.AvgPool2d(3, 2, 1)(x)))
    c = L.Flatten(1, 2)(L.Tanh()(L.Concat(1)(a, b)))  # (N, 40, 5)
    c = L.Flatten(2)(L.Linear(5, 5)(L.Flatten(1, 1)(c)))  # (N, 40, 5)
    c = L.Flatten()(L.BatchNorm1d(40)(c))
    net = Network(x, L.Linear(200, 6)(L.Dropout(0.3)(c)), name="misc")
    xs = rng.standard_normal((4, 3, 9, 9)).astype(np.float32)
    t = trained(net, xs, rng.integers(0, 6, 4))
    export_onnx(net, tmp_path / "m.onnx")
    logits = assert_same(t, tmp_path / "m.onnx", xs)
    export_onnx(net, tmp_path / "p.onnx", head="softmax")
    export_onnx(net, tmp_path / "l.onnx", head="log_softmax")
    e = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(run_onnx(tmp_path / "p.onnx", xs)[0],
                               e / e.sum(-1, keepdims=True), **TOL)
    np.testing.assert_allclose(run_onnx(tmp_path / "l.onnx", xs)[0],
                               np.log(e / e.sum(-1, keepdims=True)), **TOL)


def test_gate_order_is_converted(tmp_path):
    """The fused LSTM's file holds ONNX's i,o,f,c blocks: the f block of W is PyTorch's."""
    net = char_rnn(7, 4, 4, 1, steps=3, cell="lstm")
    model = export_onnx(net, tmp_path / "r.onnx")
    w = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}["lstm.W_l0"]
    ih = dict(net.named_parameters())["lstm.weight_ih_l0"].data
    h = 4
    np.testing.assert_array_equal(w[0, 2 * h:3 * h], ih[h:2 * h])  # f
    np.testing.assert_array_equal(w[0, h:2 * h], ih[3 * h:])  # o


def test_unsupported_layers_are_one_line(tmp_path):
    x = Input((4,))
    net = Network(x, L.BatchNorm1d(2, track_running_stats=False)(L.Linear(4, 2)(x)))
    with pytest.raises(OnnxExportError, match=r"layer 'batchnorm1d1' .*running statistics"):
        export_onnx(net, tmp_path / "x.onnx")
    y = Input((4,), dtype="int64")
    loss = Network([x, y], L.MSELoss()(L.Linear(4, 4)(x), x), name="lossy")
    with pytest.raises(OnnxExportError) as e:
        export_onnx(loss, tmp_path / "x.onnx")
    assert "'mseloss1'" in str(e.value) and "MSELoss is not supported" in str(e.value)
    assert "\n" not in str(e.value) and "Conv2d" in str(e.value)
    assert "MultiHeadAttention" in SUPPORTED_LAYERS and "LSTM" in SUPPORTED_LAYERS
    with pytest.raises(OnnxExportError, match="opset 11"):
        export_onnx(Network(x, L.ReLU()(x)), tmp_path / "x.onnx", opset=11)


# --------------------------------------------------------------------------- the command
def minidl(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """``minidl argv`` in this process, with the export subcommand registered (whether or not
    minidl/cli.py registers it already): (exit code, stdout, stderr)."""
    build = cli.build_parser

    def with_export() -> argparse.ArgumentParser:
        p = build()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        if "export" not in sub.choices:
            add_parser(sub)
        return p

    monkeypatch.setattr(cli, "build_parser", with_export)
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("minidl: error: "), err
    assert "Traceback" not in err and out == ""
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def smallcnn_checkpoint(tmp_path_factory):
    """A smallcnn of width 4 on 1x8x8 images (digits' size), 3 classes, trained 2 steps and
    saved as minidl train --save writes it."""
    rng = np.random.default_rng(5)
    net = get_model("smallcnn", (1, 8, 8), 3, width=4)
    t = trained(net, rng.standard_normal((4, 1, 8, 8)).astype(np.float32),
                rng.integers(0, 3, 4))
    path = tmp_path_factory.mktemp("ck") / "ck.npz"
    t.save(path)
    return path, t


def test_cli_exports_a_checkpoint(smallcnn_checkpoint, tmp_path, monkeypatch, capsys):
    ck, t = smallcnn_checkpoint
    out = tmp_path / "out.onnx"
    # width, classes and the input size come from the weights
    code, stdout, err = minidl(monkeypatch, capsys, "export", ck, "--model", "smallcnn",
                               "--onnx", out, "--check")
    assert code == 0, err
    assert f"wrote {out}: smallcnn, input (batch, 1, 8, 8)" in stdout
    assert "match" in stdout and "DIFFER" not in stdout
    x = np.random.default_rng(6).standard_normal((5, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(out, x)[0], t.predict(x), **TOL)
    code, stdout, err = minidl(monkeypatch, capsys, "export", ck, "--model", "smallcnn",
                               "--onnx", out, "--input", "1x8x8", "--head", "softmax",
                               "--json")
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["input"] == ["batch", 1, 8, 8] and rep["head"] == "softmax"
    np.testing.assert_allclose(run_onnx(out, x)[0].sum(-1), 1.0, rtol=1e-6)


def test_cli_finds_the_input_size(tmp_path, monkeypatch, capsys):
    """resnet20 (global pooling) is exported for any image size; vgg11_bn's weights fit 8x8
    and 32x32 networks of different poolings: the command asks for --input."""
    net = get_model("resnet20", (3, 32, 32), 4, width=4)
    Trainer(net).save(tmp_path / "r.npz")
    code, stdout, err = minidl(monkeypatch, capsys, "export", tmp_path / "r.npz", "--model",
                               "resnet20", "--onnx", tmp_path / "r.onnx")
    assert code == 0, err
    assert "input (batch, 3, height, width)" in stdout
    x = np.random.default_rng(7).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(tmp_path / "r.onnx", x)[0], Trainer(net).predict(x),
                               **TOL)
    Trainer(get_model("vgg11_bn", (3, 32, 32), 4, width=8)).save(tmp_path / "v.npz")
    # (the sizes tried cut to two: a 224x224 VGG has a 4096-wide classifier, seconds to build)
    monkeypatch.setattr(export_cmd, "SIDES", (8,))
    monkeypatch.setattr(export_cmd, "own_input_shape", lambda name: (3, 32, 32))
    one_line_error(*minidl(monkeypatch, capsys, "export", tmp_path / "v.npz", "--model",
                           "vgg11_bn", "--onnx", tmp_path / "v.onnx"),
                   "fit vgg11_bn on inputs of 3x32x32, 3x8x8", "--input")
    code, stdout, err = minidl(monkeypatch, capsys, "export", tmp_path / "v.npz", "--model",
                               "vgg11_bn", "--input", "3x32x32", "--onnx", tmp_path / "v.onnx",
                               "--check")
    assert code == 0 and "input (batch, 3, 32, 32)" in stdout and "match" in stdout, err


def test_cli_takes_the_model_from_safetensors(tmp_path, monkeypatch, capsys):
    """minidl train --save FILE.safetensors names the model in the file: no --model needed."""
    pytest.importorskip("safetensors")
    from minidl.interop.safetensors_io import save_safetensors

    net = get_model("lenet5", (1, 8, 8), 4)
    save_safetensors(net, tmp_path / "w.safetensors", metadata={"minidl.model": "lenet5"})
    code, stdout, err = minidl(monkeypatch, capsys, "export", tmp_path / "w.safetensors",
                               "--onnx", tmp_path / "w.onnx", "--check")
    assert code == 0 and "lenet5, input (batch, 1, 8, 8)" in stdout and "match" in stdout, err


def test_cli_without_onnx_is_one_line(smallcnn_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx fails
    code, out, err = minidl(monkeypatch, capsys, "export", smallcnn_checkpoint[0], "--model",
                            "smallcnn", "--onnx", tmp_path / "x.onnx")
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.strip() == ("minidl: error: minidl export --onnx needs onnx, which is not "
                           "installed: pip install 'minidl[onnx]'")


@pytest.mark.parametrize("name", ["char-gru", "gpt-char"])
def test_cli_exports_sequence_models(name, tmp_path, monkeypatch, capsys):
    """Vocabulary, width and a transformer's context are read back from the weights."""
    net = get_model(name, (8,), 9, width=12)
    ck = tmp_path / "ck.npz"
    Trainer(net).save(ck)
    out = tmp_path / "out.onnx"
    code, stdout, err = minidl(monkeypatch, capsys, "export", ck, "--model", name, "--onnx",
                               out, "--seq-len", "8", "--check", "--json")
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["matches"] and rep["input"] == ["batch", "seq"] and rep["max_abs_difference"] < 1e-5


def test_cli_bad_input_is_one_line(smallcnn_checkpoint, tmp_path, monkeypatch, capsys):
    ck, _ = smallcnn_checkpoint
    out = str(tmp_path / "out.onnx")

    def run(*argv):
        return minidl(monkeypatch, capsys, "export", *argv)

    one_line_error(*run(tmp_path / "nope.npz", "--model", "smallcnn", "--onnx", out),
                   "nope.npz: no such file")
    one_line_error(*run(ck, "--model", "resnet21", "--onnx", out), "no ResNet of depth 21")
    one_line_error(*run(ck, "--model", "nonet", "--onnx", out), "unknown model 'nonet'")
    one_line_error(*run(ck, "--onnx", out), "--model NAME")
    one_line_error(*run(ck, "--model", "lenet5", "--onnx", out), "does not match lenet5")
    one_line_error(*run(ck, "--model", "smallcnn", "--input", "1x16x16", "--onnx", out),
                   "does not match smallcnn", "fc.weight")
    text = tmp_path / "notes.npz"
    text.write_text("hello")
    one_line_error(*run(text, "--model", "smallcnn", "--onnx", out), "not a minidl checkpoint")
    one_line_error(*run(ck, "--model", "smallcnn", "--onnx", tmp_path / "no" / "x.onnx"),
                   "--onnx")
    one_line_error(*run(ck, "--model", "smallcnn", "--onnx", out, "--opset", "9"), "opset 9")
    one_line_error(*run(ck, "--model", "smallcnn", "--onnx", out, "--head", "probs"), "--head")


def test_cli_unsupported_layer_is_one_line(smallcnn_checkpoint, tmp_path, monkeypatch,
                                           capsys):
    def with_unsupported(args):
        x = Input((4,))
        net = Network(x, L.BatchNorm1d(2, track_running_stats=False)(L.Linear(4, 2)(x)),
                      name="odd")
        return net, (4,), "odd"

    monkeypatch.setattr(export_cmd, "load_model", with_unsupported)
    ck, _ = smallcnn_checkpoint
    one_line_error(*minidl(monkeypatch, capsys, "export", ck, "--model", "smallcnn", "--onnx",
                           tmp_path / "x.onnx"), "cannot export layer 'batchnorm1d1'",
                   "BatchNorm1d")
