"""Attention's memory form as plan data (memory/options/attention_options.py) through real
lowerings,
and the transformer layers under every lossless strategy (bit-identical to ``none``)."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.compile.lowering import lower
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.payloads import OpOptions
from minidl.memory.options import attention_options as A
from minidl.net.builder import named
from minidl.net.graph import Input, Network
from minidl.net.optim import SGD


def tiny_gpt(vocab=11, t=8, d=8, h=2, causal=True, dropout=0.1, layers=1) -> Network:
    """A pre-LN decoder with every transformer layer: token and positional embeddings,
    LayerNorm, attention, dropout, residual adds, an MLP with GELU, a head."""
    x = Input((t,), dtype="int64")
    r = named(L.Embedding(vocab, d), "wte")(x)
    r = named(L.PositionalEmbedding(t, d), "wpe")(r)
    for i in range(layers):
        a = named(L.LayerNorm(d), f"h{i}.ln_1")(r)
        a = named(L.MultiHeadAttention(d, h, causal=causal, dropout=dropout), f"h{i}.attn")(a)
        a = named(L.Dropout(dropout), f"h{i}.drop")(a)
        r = L.Add()(r, a)
        m = named(L.LayerNorm(d), f"h{i}.ln_2")(r)
        m = named(L.Linear(d, 4 * d), f"h{i}.fc")(m)
        m = named(L.GELU("tanh" if i % 2 else "none"), f"h{i}.gelu")(m)
        m = named(L.Linear(4 * d, d), f"h{i}.proj")(m)
        r = L.Add()(r, m)
    o = named(L.LayerNorm(d), "ln_f")(r)
    return Network(x, named(L.Linear(d, vocab), "head")(o), name="tiny-gpt")


def _lowered(t, form, dtype="float32", b=2, d=8, h=2):
    net = tiny_gpt(t=t, d=d, h=h)
    if dtype != "float32":
        for p in net.parameters():
            p.data = p.data.astype(dtype)
    first = lower(net, [(b, t)], loss=L.SoftmaxCrossEntropy(), label_shape=(b, t))
    opts = A.options_for(first.program, form)
    return lower(net, [(b, t)], loss=L.SoftmaxCrossEntropy(), label_shape=(b, t),
                 options=opts).program


def _attn_bytes(program):
    """(stash, forward workspace, backward workspace) bytes of the attention op as lowered."""
    ts = program.tensors
    stash = sum(ts[i].nbytes for i in range(len(ts))
                if ts[i].category == "stash" and ts[i].layer == "h0.attn")
    ws = {st.phase: ts[st.access.workspace].nbytes for st in program.steps
          if st.layer == "h0.attn" and st.access.workspace >= 0}
    return stash, ws.get("forward", 0), ws.get("backward", 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_form_bytes_are_the_lowered_bytes(dtype):
    program = _lowered(40, None, dtype)
    (step,) = A.attention_steps(program)
    forms = A.candidates(step)
    assert forms == ["keep", "blockwise:40", "blockwise:32"]
    for form in forms:
        low = _lowered(40, form, dtype)
        (st,) = A.attention_steps(low)
        assert st.op.options == OpOptions(attn=form)
        fb = A.form_bytes(low, st, form)
        assert (fb.stash, fb.forward_workspace, fb.backward_workspace) == _attn_bytes(low), form


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_forms_are_priced_in_the_half_dtype(precision):
    """Under mixed precision attention computes in half on a float32 input (LayerNorm's): its
    stash is half (the log-sum-exp float32), as the lowering declares it."""
    net, (b, t) = tiny_gpt(t=40), (2, 40)
    kw = dict(loss=L.SoftmaxCrossEntropy(), label_shape=(b, t))
    fp32 = A.form_bytes(p := _lowered(t, None), A.attention_steps(p)[0], None)
    first = lower(net, [(b, t)], precision=precision, **kw).program
    for form in A.candidates(A.attention_steps(first)[0]):
        low = lower(net, [(b, t)], precision=precision,
                    options=A.options_for(first, form), **kw).program
        (st,) = A.attention_steps(low)
        fb = A.form_bytes(low, st, form)
        own = {ts.name: ts for ts in low.tensors
               if ts.category == "stash" and ts.layer == "h0.attn" and "@" not in ts.name}
        assert fb.stash == sum(ts.nbytes for ts in own.values()), form
        # the step's workspace also holds the weights it rounds to half (as every step of a
        # matrix op does, beside the layer's own)
        assert set(st.forward.param_casts) == set(st.forward.params)
        rounded = sum(int(np.prod(low.tensors[t].shape)) * 2 for t in st.forward.params.values())
        assert fb.forward_workspace + rounded == _attn_bytes(low)[1], form
        if form == "keep":
            assert 2 * fb.stash == fp32.stash
        else:
            assert str(own["h0.attn.lse"].dtype) == "float32"


def test_blockwise_stash_is_linear_in_t_and_keep_quadratic():
    ts = (64, 128, 256, 512)
    keep = [_attn_bytes(_lowered(t, "keep"))[0] for t in ts]
    blk = [_attn_bytes(_lowered(t, "blockwise:32"))[0] for t in ts]
    assert len({s // t for s, t in zip(blk, ts, strict=True)}) == 1  # bytes per position
    assert all(s % t == 0 for s, t in zip(blk, ts, strict=True))
    assert keep[-1] - keep[-2] > 3 * (keep[1] - keep[0])  # second differences grow
    ws = [_attn_bytes(_lowered(t, "blockwise:32"))[2] for t in ts]
    steps = [(w1 - w0) / (t1 - t0) for w0, w1, t0, t1 in zip(ws, ws[1:], ts, ts[1:])]
    assert max(steps) - min(steps) < 1, steps  # workspace: tiles + a linear part
    assert blk[-1] < keep[-1] / 10


def test_policies_and_errors():
    program = _lowered(64, None)
    assert A.policies(program, MemoryConfig.parse("reuse")) == [None]
    auto = A.policies(program, MemoryConfig.parse("auto,budget=1GiB"))
    assert auto == ["keep", "blockwise:64", "blockwise:32"]
    assert A.options_for(program, None) == {}
    with pytest.raises(ValueError, match="attention form 'flash'"):
        A.options_for(program, "flash")


# ------------------------------------------------------------------ through the engine
SPECS = ["reuse", "inplace", "static", "swap=all", "reuse,inplace", "reuse,inplace,static",
         "reuse,swap=all", "reuse,swap=conv,cache",
         "reuse,swap=auto", "reuse,recompute=sqrt", "reuse,recompute=speed",
         "reuse,recompute=memory", "reuse,recompute=cost",
         "reuse,inplace,recompute=cost,swap=all", "superneurons"]


def _train(spec, x, y, steps=2):
    net = tiny_gpt(layers=2)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9), memory=spec,
                        device_memory="16MiB", debug=True)
    losses = [tr.step(x, y) for _ in range(steps)]
    return losses, {n: np.array(p.grad) for n, p in net.named_parameters()}, tr


@pytest.mark.parametrize("form", [None, "blockwise:3"])
def test_strategies_bit_identical_to_none_and_dry_run_exact(form, monkeypatch):
    """Every lossless strategy gives none's losses and gradients bit for bit, with the
    probabilities kept and blockwise (the form forced on every plan), dropout on; the dry
    run's peak is the real one."""
    if form is not None:
        monkeypatch.setattr(A, "policies", lambda program, config: [form])
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 11, (3, 8)), rng.integers(0, 11, (3, 8))
    base = _train("none", x, y)
    for spec in SPECS:
        run = _train(spec, x, y)
        assert run[0] == base[0], spec
        for n, g in base[1].items():
            assert np.array_equal(run[1][n], g), (spec, n)
        rep = minidl.dry_run(tiny_gpt(layers=2), 3, spec, input_shape=(8,), label_shape=(3, 8))
        assert rep["peak_allocated_bytes"] == run[2].memory_report()["peak_allocated_bytes"]


def test_auto_budget_chooses_blockwise_when_keep_cannot_fit():
    t, b = 256, 4
    net = lambda: tiny_gpt(t=t, d=16, h=4, dropout=0.0)  # noqa: E731
    peak = {}
    for form in ("keep", "blockwise:64"):
        mp = pytest.MonkeyPatch()
        mp.setattr(A, "policies", lambda program, config, form=form: [form])
        peak[form] = minidl.dry_run(net(), b, "reuse,inplace", input_shape=(t,),
                                    label_shape=(b, t))["peak_allocated_bytes"]
        mp.undo()
    assert peak["blockwise:64"] < peak["keep"] / 2
    budget = (peak["blockwise:64"] + peak["keep"] // 3)
    rep = minidl.dry_run(net(), b, f"auto,budget={budget}", input_shape=(t,),
                         label_shape=(b, t))
    assert rep["peak_allocated_bytes"] <= budget
    note = next(n for n in rep["notes"] if n.startswith(A.NOTE_PREFIX))
    assert "form blockwise:" in note, note
