"""Mixed precision for transformers and recurrent networks on the CPU (issue 46): a GPT (token
and positional embeddings, layer norm, causal attention, GELU, a tied head) and the fused and
unrolled LSTM / GRU language models train in bf16-mixed and fp16-mixed; the dry run's peak is
the real run's, the lossless memory specs are bit-identical to ``none`` within the precision
(the fused layers' BPTT schedules recompute units), and loss and gradients are PyTorch CPU
autocast's within half rounding."""

from __future__ import annotations

import json

import numpy as np
import pytest

import minidl
from minidl.cli import main
from minidl.net.optim import SGD
from minidl.zoo.rnn import char_rnn
from minidl.zoo.transformers import TransformerConfig, gpt

MIXED = ["bf16-mixed", "fp16-mixed"]
HALF = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
#: Unit roundoff of each half dtype.
EPS = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}
VOCAB = 13
#: Three 16-step units of the fused layers (their BPTT schedules then recompute units).
T_FUSED = 40
#: model -> (build, sequence length)
MODELS = {
    "gpt": (lambda: gpt(TransformerConfig(2, 2, 16, 8, VOCAB, dropout=0.1)), 8),
    "lstm": (lambda: char_rnn(VOCAB, 8, 12, 2, steps=T_FUSED), T_FUSED),
    "gru": (lambda: char_rnn(VOCAB, 8, 12, 2, steps=T_FUSED, cell="gru"), T_FUSED),
    "lstm-unrolled": (lambda: char_rnn(VOCAB, 8, 12, 2, steps=6, fused=False), 6),
}
SPECS = ("none", "reuse,inplace", "reuse,swap=all", "reuse,recompute=sqrt",
         "reuse,inplace,static")


def _tokens(n, t, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, t)), rng.integers(0, VOCAB, (n, t))


def _trainer(net, precision, spec="none", lr=0.05):
    return minidl.Trainer(net, SGD(net.parameters(), lr=lr, momentum=0.9), memory=spec,
                          device_memory="64MiB", precision=precision, debug=True)


@pytest.mark.parametrize("precision", ["fp32", *MIXED])
@pytest.mark.parametrize("model", ["gpt", "lstm"])
def test_dry_run_equals_real_run(precision, model):
    make, t = MODELS[model]
    x, y = _tokens(4, t)
    net = make()
    tr = _trainer(net, precision, "reuse,inplace")
    tr.step(x, y)
    tr.step(x, y)
    rep = minidl.dry_run(make(), 4, "reuse,inplace", input_shape=(t,), precision=precision)
    real = tr.memory_report()
    assert real["peak_allocated_bytes"] == rep["peak_allocated_bytes"]
    assert real["peak_reserved_bytes"] == rep["peak_reserved_bytes"]
    assert all(p.data.dtype == np.float32 and p.grad.dtype == np.float32
               for p in net.parameters())
    if precision == "fp32":
        return
    half = HALF[precision]
    dtypes = {s.name: str(s.dtype) for s in tr.last_compiled.plan.program.tensors}
    if model == "gpt":  # autocast: embeddings and layer norm float32, attention half
        assert dtypes["transformer.wte"] == dtypes["transformer.wpe"] == "float32"
        assert dtypes["transformer.h.0.ln_1"] == "float32"
        assert dtypes["transformer.h.0.attn"] == dtypes["transformer.h.0.attn.probs"] == half
        assert dtypes["transformer.h.0.add_1"] == "float32"  # the residual stream promotes
        assert dtypes["lm_head"] == half
    else:  # the recurrence: output, kept gates and states half (rounded step by step)
        assert dtypes["lstm"] == half
        assert dtypes["lstm.gates"] == dtypes["lstm.h"] == half
    assert dtypes["loss"] == "float32"
    # every step of a matrix op rounds its weights itself (no copy kept from forward to
    # backward): the tied lm head too, and the recurrence's weights
    casts = {(st.layer, st.phase.value): st.forward.param_casts
             for st in tr.last_compiled.plan.program.steps if st.forward.param_casts}
    weight = {"gpt": ("lm_head", "weight"), "lstm": ("lstm", "weight_hh_l0")}.get(model)
    if weight is not None:
        for phase in ("forward", "backward"):
            assert casts[(weight[0], phase)][weight[1]] == half


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", list(MODELS))
def test_lossless_specs_bit_identical_to_none_within_the_precision(precision, model):
    make, t = MODELS[model]
    x, y = _tokens(3, t)
    runs = {}
    for spec in SPECS:
        net = make()
        tr = _trainer(net, precision, spec)
        losses = [tr.step(x, y) for _ in range(3)]
        runs[spec] = losses, {n: np.array(p.grad) for n, p in net.named_parameters()}
        rep = minidl.dry_run(make(), 3, spec, input_shape=(t,), precision=precision)
        assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"], spec
        assert runs[spec][0] == runs["none"][0], spec
        for n, g in runs["none"][1].items():
            assert np.array_equal(runs[spec][1][n], g), (spec, n)


def _torch_reference(net, x, y, precision):
    torch = pytest.importorskip("torch")
    from minidl.interop.torch_bridge import to_torch

    tm = to_torch(net)
    tm.train()
    with torch.autocast("cpu", dtype=getattr(torch, HALF[precision])):
        out = tm(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB),
                                                 torch.from_numpy(y).reshape(-1))
    loss.backward()
    theirs = dict(tm.named_parameters())
    keys = {}  # a graph module's parameters are mods.<node>.<local name>
    for node in net.nodes if hasattr(tm, "mods") else ():
        for local, p in net.layer_params(node.name).items():
            keys.setdefault(id(p), f"mods.{node.name.replace('.', '_')}.{local}")
    return float(loss.detach()), {n: theirs[keys.get(id(p), n)].grad.float().numpy()
                                  for n, p in net.named_parameters()}


@pytest.mark.parametrize("model, precision", [
    ("gpt-block", "bf16-mixed"), ("gpt-block", "fp16-mixed"), ("lstm", "bf16-mixed"),
    ("gru", "bf16-mixed")])
def test_loss_and_gradients_match_pytorch_cpu_autocast(model, precision):
    """One GPT block (no dropout) and the fused LSTM / GRU (PyTorch's CPU LSTM has no float16
    kernel: oneDNN refuses it under autocast to float16)."""
    if model == "gpt-block":
        make, t = (lambda: gpt(TransformerConfig(1, 2, 16, 6, VOCAB))), 6
    else:
        make, t = MODELS[model]
    x, y = _tokens(4, t, seed=1)
    ref_loss, ref_grads = _torch_reference(make(), x, y, precision)
    net = make()
    loss = _trainer(net, precision, lr=0.0).compute_gradients(x, y)
    eps = EPS[precision]
    assert abs(loss - ref_loss) <= 2 * eps * abs(ref_loss)
    params = dict(net.named_parameters())
    for name, g in ref_grads.items():  # within a few half roundings of the tensor's largest
        err = np.abs(params[name].grad - g).max()
        assert err <= 4 * eps * np.abs(g).max() + 1e-7, (name, err)


@pytest.mark.parametrize("model, extra", [("gpt-char", ["--width", "12"]), ("char-lstm", [])])
def test_cli_trains_the_text_models_in_fp16(capsys, model, extra):
    assert main(["train", model, "--dataset", "synthetic", "--seq-len", "8", "--batch-size", "2",
                 "--max-steps", "2", "--precision", "fp16-mixed", "--no-progress", "--json",
                 *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp16-mixed" and np.isfinite(out["val_loss"])
    assert out["skipped_steps"] == 0 and out["loss_scale"] == 2.0 ** 16
    assert main(["train", model, "--dataset", "synthetic", "--seq-len", "8", "--batch-size", "2",
                 "--max-steps", "2", "--precision", "fp16-mixed", "--no-progress", *extra]) == 0
    assert ("precision: fp16-mixed (float16 compute, float32 master weights), final loss scale "
            "65536, 0 steps skipped (inf/NaN gradients)") in capsys.readouterr().out.splitlines()
