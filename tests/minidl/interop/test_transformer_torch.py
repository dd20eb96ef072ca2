"""A 2-layer GPT (causal) and a 2-layer BERT-style encoder (not causal) against independent
PyTorch modules written here (PyTorch is the oracle only): the same weights, copied over by
name, give the same loss and the same gradient of every parameter in float64, dropout off."""

from __future__ import annotations

import math

import numpy as np
import pytest

import minidl
from minidl.net.optim import SGD
from minidl.zoo.transformers import TransformerConfig, bert, gpt

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

CONFIG = TransformerConfig(layers=2, heads=2, dim=16, context=6, vocab=13, dropout=0.0)
#: Our attention parameter (local name) -> the torch modules' (nanoGPT's c_attn / c_proj).
ATTENTION_NAMES = {"qkv.weight": "c_attn.weight", "qkv.bias": "c_attn.bias",
                   "proj.weight": "c_proj.weight", "proj.bias": "c_proj.bias"}


class SelfAttention(nn.Module):
    """nanoGPT's CausalSelfAttention, causal or not, through scaled_dot_product_attention."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.heads, self.causal = heads, causal

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, fc: str, proj: str, approximate: str) -> None:
        super().__init__()
        self.names = (fc, proj)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.approximate = approximate

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class TorchGPT(nn.Module):
    """nanoGPT's GPT: pre-LN blocks, final LayerNorm, head tied to the token embedding."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.context, c.dim)
        self.ln_1 = nn.ModuleList(nn.LayerNorm(c.dim, c.eps) for _ in range(c.layers))
        self.attn = nn.ModuleList(SelfAttention(c.dim, c.heads, True) for _ in range(c.layers))
        self.ln_2 = nn.ModuleList(nn.LayerNorm(c.dim, c.eps) for _ in range(c.layers))
        self.mlp = nn.ModuleList(MLP(c.dim, "c_fc", "c_proj", c.gelu) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim, c.eps)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for ln_1, attn, ln_2, mlp in zip(self.ln_1, self.attn, self.ln_2, self.mlp):
            x = x + attn(ln_1(x))
            x = x + mlp(ln_2(x))
        return self.ln_f(x) @ self.wte.weight.T

    def parameter_for(self, name: str):
        """The torch parameter behind one of our parameter names."""
        parts = name.split(".")
        if parts[1] in ("wte", "wpe", "ln_f"):
            return getattr(getattr(self, parts[1]), parts[2])
        i, what, rest = int(parts[2]), parts[3], parts[4:]
        module = getattr(self, what)[i]
        if what == "attn":
            return module.get_parameter(ATTENTION_NAMES[".".join(rest)])
        if what == "mlp":
            return getattr({"c_fc": module.fc, "c_proj": module.proj}[rest[0]], rest[1])
        return getattr(module, rest[0])


class TorchBERT(nn.Module):
    """BERT: post-LN encoder layers after LN(tokens + positions), the masked-LM head (dense,
    GELU, LayerNorm, decoder tied to the word embedding, its own bias)."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.words, self.positions = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.context, c.dim)
        self.ln_emb = nn.LayerNorm(c.dim, c.eps)
        self.attn = nn.ModuleList(SelfAttention(c.dim, c.heads, False) for _ in range(c.layers))
        self.ln_attn = nn.ModuleList(nn.LayerNorm(c.dim, c.eps) for _ in range(c.layers))
        self.mlp = nn.ModuleList(MLP(c.dim, "intermediate", "output", c.gelu)
                                 for _ in range(c.layers))
        self.ln_out = nn.ModuleList(nn.LayerNorm(c.dim, c.eps) for _ in range(c.layers))
        self.dense, self.ln_head = nn.Linear(c.dim, c.dim), nn.LayerNorm(c.dim, c.eps)
        self.bias = nn.Parameter(torch.zeros(c.vocab))
        self.approximate = c.gelu

    def forward(self, idx):
        x = self.ln_emb(self.words(idx) + self.positions(torch.arange(idx.shape[1])))
        for attn, ln_a, mlp, ln_o in zip(self.attn, self.ln_attn, self.mlp, self.ln_out):
            x = ln_a(x + attn(x))
            x = ln_o(x + mlp(x))
        h = self.ln_head(F.gelu(self.dense(x), approximate=self.approximate))
        return h @ self.words.weight.T + self.bias

    def parameter_for(self, name: str):
        parts = name.split(".")
        if name == "cls.predictions.bias":
            return self.bias
        if parts[0] == "cls":
            module = self.dense if parts[3] == "dense" else self.ln_head
            return getattr(module, parts[4])
        if parts[1] == "embeddings":
            return getattr({"word_embeddings": self.words, "position_embeddings": self.positions,
                            "LayerNorm": self.ln_emb}[parts[2]], parts[3])
        i, rest = int(parts[3]), parts[4:]
        if rest[0] == "attention" and rest[1] != "output":
            return self.attn[i].get_parameter(ATTENTION_NAMES[".".join(rest[1:])])
        if rest[:3] == ["attention", "output", "LayerNorm"]:
            return getattr(self.ln_attn[i], rest[3])
        if rest[0] == "intermediate":
            return getattr(self.mlp[i].fc, rest[2])
        if rest[:2] == ["output", "dense"]:
            return getattr(self.mlp[i].proj, rest[2])
        return getattr(self.ln_out[i], rest[2])


def _compare(net, module, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ours = dict(net.named_parameters())
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases too
        for name, p in ours.items():
            p.data = p.data + 0.1 * rng.standard_normal(p.shape)
            module.parameter_for(name).copy_(torch.from_numpy(p.data))
    covered = {id(module.parameter_for(n)) for n in ours}
    assert covered == {id(p) for p in module.parameters()}, "name mapping misses parameters"
    x = rng.integers(0, CONFIG.vocab, (3, CONFIG.context))
    y = rng.integers(0, CONFIG.vocab, (3, CONFIG.context))
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.0), device_memory="16MiB")
    loss = tr.compute_gradients(x, y)
    module = module.double()
    logits = module(torch.from_numpy(x))
    ref = F.cross_entropy(logits.reshape(-1, CONFIG.vocab), torch.from_numpy(y).reshape(-1))
    ref.backward()
    assert math.isclose(loss, float(ref.detach()), rel_tol=1e-12)
    for name, p in ours.items():
        g = module.parameter_for(name).grad.numpy()
        np.testing.assert_allclose(p.grad, g, rtol=1e-9, atol=1e-12, err_msg=name)


def test_gpt_gradients_equal_pytorch_float64():
    torch.manual_seed(0)
    _compare(gpt(CONFIG, dtype="float64"), TorchGPT(CONFIG).double(), seed=1)


@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_bert_encoder_gradients_equal_pytorch_float64(gelu):
    from dataclasses import replace

    c = replace(CONFIG, gelu=gelu, eps=1e-12)
    torch.manual_seed(0)
    _compare(bert(c, dtype="float64"), TorchBERT(c).double(), seed=2)


@pytest.mark.slow
def test_gpt_bench_times_torch_in_its_own_process_from_the_same_weights():
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[3] / "benchmarks" / "speed"
    code = (f"import sys; sys.path.insert(0, {str(bench)!r}); import gpt_bench; "
            "gpt_bench.main(['--rounds', '1', '--block', '1', '--batch-size', '2', "
            "'--seq-len', '8', '--dropout', '0']); "
            "print('torch in parent:', 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "torch in parent: False" in res.stdout and "ratio" in res.stdout
    losses = res.stdout.split("minidl ")[1].split(", torch ")
    assert float(losses[0]) == pytest.approx(float(losses[1].split()[0]), rel=1e-5)


def test_to_torch_builds_the_transformers_with_tied_weights():
    """minidl.interop.torch_bridge (``minidl bench --compare-torch``): the same loss, and one torch
    parameter for the embedding and the head they share."""
    from minidl.interop.torch_bridge import to_torch

    c = TransformerConfig(layers=2, heads=2, dim=16, context=6, vocab=13, dropout=0.0)
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 13, (3, 6)), rng.integers(0, 13, (3, 6))
    for net in (gpt(c), bert(c)):
        module = to_torch(net)
        assert sum(p.numel() for p in module.parameters()) == net.num_parameters()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.0), device_memory="16MiB")
        loss = tr.compute_gradients(x, y)
        out = module(torch.from_numpy(x))
        ref = F.cross_entropy(out.reshape(-1, 13), torch.from_numpy(y).reshape(-1))
        assert math.isclose(loss, float(ref.detach()), rel_tol=1e-5)
