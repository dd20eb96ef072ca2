"""Transformer models: GPT (a pre-LN decoder, nanoGPT's layout) and BERT (a post-LN encoder).

* ``gpt-char``: 6 layers, 6 heads, 384 wide, context 256, a character vocabulary (nanoGPT's
  shakespeare_char configuration, dropout 0.2).
* ``gpt2-small``: 12 layers, 12 heads, 768 wide, context 1024, vocabulary 50257 (GPT-2 124M).
* ``bert-base``: 12 layers, 12 heads, 768 wide, sequence 512, vocabulary 30522 (BERT-base),
  with the masked-language-model head of pre-training (the setting of the survey's 73 GB).

A GPT block is ``x + drop(attn(ln_1(x)))`` then ``x + drop(mlp(ln_2(x)))`` (``mlp`` = Linear
D->4D, GELU, Linear 4D->D), a final LayerNorm and a head to the vocabulary tied to the token
embedding. A BERT layer is ``LN(x + drop(attn(x)))`` then ``LN(x + drop(mlp(x)))`` after
``drop(LN(tokens + positions))``; its head is Linear D->D, GELU, LayerNorm and a decoder to
the vocabulary tied to the word embedding, with its own bias (BERT's ``cls.predictions``).
Left out of BERT: the token-type (segment) embedding (one segment: a constant row, 1,536
parameters) and the pooler and next-sentence head (a 768x768 Linear on the first token only).

The sequence length is the model's context: the positional table is built with ``seq_len``
rows (``minidl plan bert-base --seq-len 4096`` plans a 4096-row table), and inputs are
(batch, seq_len) token arrays; the labels are (batch, seq_len) next tokens (GPT) or tokens to
predict (BERT: every position, where BERT's pre-training gathers the ~15 % masked ones).

Weights start as GPT-2's: every Linear and embedding weight N(0, 0.02), the projections back
into the residual stream N(0, 0.02 / sqrt(2 * layers)), biases zero, LayerNorms (1, 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .. import layers as L
from ..layers.base import Layer, ParamSpec, Symbol
from ..net.builder import named
from ..net.deferred_init import DeferredInitialiser, deferring
from ..net.graph import Input, Network
from ..net.parameter import Parameter, new_parameter


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes and choices of a transformer model (``mlp_ratio`` * ``dim`` hidden units in the
    MLP; ``gelu`` is GELU's ``approximate``: ``"none"`` (exact) or ``"tanh"``)."""

    layers: int
    heads: int
    dim: int
    context: int
    vocab: int
    dropout: float = 0.0
    gelu: str = "none"
    eps: float = 1e-5
    mlp_ratio: int = 4
    bias: bool = True

    def __post_init__(self) -> None:
        for what in ("layers", "heads", "dim", "context", "vocab", "mlp_ratio"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be >= 1, got {getattr(self, what)}")
        if self.dim % self.heads:
            raise ValueError(f"width {self.dim} is not a multiple of the {self.heads} heads")


CONFIGS: dict[str, TransformerConfig] = {
    "gpt-char": TransformerConfig(6, 6, 384, 256, 65, dropout=0.2),
    "gpt2-small": TransformerConfig(12, 12, 768, 1024, 50257, dropout=0.1, gelu="tanh"),
    "bert-base": TransformerConfig(12, 12, 768, 512, 30522, dropout=0.1, eps=1e-12),
}
TRANSFORMER_MODELS = tuple(CONFIGS)
#: Parameters projecting back into a GPT's residual stream (initialised 0.02 / sqrt(2 L)).
GPT_RESIDUAL = (".mlp.c_proj.", ".attn.proj.")


class _Graph:
    """Applies named layers and creates their parameters with GPT-2's initialisation (module
    docstring), once per name: a layer bound to a name already made shares its parameter."""

    def __init__(self, seed: int, dtype: str, residual: tuple[str, ...], layers: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.residual, self.layers = residual, layers
        self.params: dict[str, Parameter] = {}
        # (under deferred_parameters(): values drawn, in this order, when one is first read)
        self.initialiser = DeferredInitialiser("transformer") if deferring() else None

    def __call__(self, layer: Layer, name: str, *xs: Symbol,
                 names: dict[str, str] | None = None) -> Symbol:
        """``layer`` named ``name`` applied to ``xs``; its parameters are ``name.local``, or
        the store names ``names`` maps local names to (tied weights)."""
        names = names or {}
        layer.bound_params = {local: self._parameter(names.get(local, f"{name}.{local}"), spec)
                             for local, spec in layer.param_specs().items()}
        return named(layer, name)(*xs)

    def _parameter(self, full: str, spec: ParamSpec) -> Parameter:
        if full not in self.params:
            dtype = (spec.dtype or self.dtype) if spec.init in ("ones", "zeros") else self.dtype
            self.params[full] = new_parameter(
                full, spec.shape, dtype, lambda: self._initial_value(full, spec),
                trainable=spec.trainable, initialiser=self.initialiser)
        return self.params[full]

    def _initial_value(self, full: str, spec: ParamSpec) -> np.ndarray:
        if len(spec.shape) >= 2:
            std = 0.02
            if self.layers and any(r in full for r in self.residual):
                std /= math.sqrt(2 * self.layers)
            value = self.rng.standard_normal(spec.shape, dtype=np.float32)
            value *= np.float32(std)
            return value.astype(self.dtype, copy=False)
        if spec.init in ("ones", "zeros"):  # LayerNorm's scale and shift
            return spec.initial_value(self.rng, self.dtype)
        return np.zeros(spec.shape, self.dtype)  # biases


def _dropout(g: _Graph, p: float, name: str, x: Symbol) -> Symbol:
    return g(L.Dropout(p), name, x) if p > 0 else x


def _mlp(g: _Graph, c: TransformerConfig, prefix: str, x: Symbol, fc: str, proj: str
         ) -> Symbol:
    hidden = c.mlp_ratio * c.dim
    y = g(L.Linear(c.dim, hidden, bias=c.bias), f"{prefix}.{fc}", x)
    y = g(L.GELU(approximate=c.gelu), f"{prefix}.gelu", y)
    return g(L.Linear(hidden, c.dim, bias=c.bias), f"{prefix}.{proj}", y)


def _attention(g: _Graph, c: TransformerConfig, name: str, x: Symbol, causal: bool) -> Symbol:
    return g(L.MultiHeadAttention(c.dim, c.heads, causal=causal, dropout=c.dropout,
                                  bias=c.bias), name, x)


def gpt(config: TransformerConfig, name: str = "gpt", seed: int = 0,
        dtype: str = "float32") -> Network:
    """A GPT decoder (see the module docstring) over (batch, ``config.context``) tokens,
    nanoGPT's parameter names (``transformer.h.0.mlp.c_fc.weight``, ...)."""
    c = config
    g = _Graph(seed, dtype, GPT_RESIDUAL, c.layers)
    x = Input((c.context,), dtype="int64", name="tokens")
    y = g(L.Embedding(c.vocab, c.dim, dtype=dtype), "transformer.wte", x)
    y = g(L.PositionalEmbedding(c.context, c.dim), "transformer.wpe", y)
    y = _dropout(g, c.dropout, "transformer.drop", y)
    for i in range(c.layers):
        p = f"transformer.h.{i}"
        h = g(L.LayerNorm(c.dim, c.eps), f"{p}.ln_1", y)
        h = _attention(g, c, f"{p}.attn", h, causal=True)
        h = _dropout(g, c.dropout, f"{p}.attn.resid_dropout", h)
        y = g(L.Add(), f"{p}.add_1", y, h)
        h = g(L.LayerNorm(c.dim, c.eps), f"{p}.ln_2", y)
        h = _mlp(g, c, f"{p}.mlp", h, "c_fc", "c_proj")
        h = _dropout(g, c.dropout, f"{p}.mlp.dropout", h)
        y = g(L.Add(), f"{p}.add_2", y, h)
    y = g(L.LayerNorm(c.dim, c.eps), "transformer.ln_f", y)
    y = g(L.Linear(c.dim, c.vocab, bias=False), "lm_head", y,
          names={"weight": "transformer.wte.weight"})
    net = Network(x, y, name=name, seed=seed, dtype=dtype)
    net.vocab_size = c.vocab
    return net


def bert(config: TransformerConfig, name: str = "bert", seed: int = 0,
         dtype: str = "float32") -> Network:
    """A BERT encoder with the masked-LM head (see the module docstring) over (batch,
    ``config.context``) tokens, Hugging Face's names where the layouts agree
    (``bert.encoder.layer.0.intermediate.dense.weight``, ...)."""
    c = config
    g = _Graph(seed, dtype, (), 0)
    x = Input((c.context,), dtype="int64", name="tokens")
    e = "bert.embeddings"
    y = g(L.Embedding(c.vocab, c.dim, dtype=dtype), f"{e}.word_embeddings", x)
    y = g(L.PositionalEmbedding(c.context, c.dim), f"{e}.position_embeddings", y)
    y = g(L.LayerNorm(c.dim, c.eps), f"{e}.LayerNorm", y)
    y = _dropout(g, c.dropout, f"{e}.dropout", y)
    for i in range(c.layers):
        p = f"bert.encoder.layer.{i}"
        h = _attention(g, c, f"{p}.attention", y, causal=False)
        h = _dropout(g, c.dropout, f"{p}.attention.output.dropout", h)
        y = g(L.Add(), f"{p}.attention.output.add", y, h)
        y = g(L.LayerNorm(c.dim, c.eps), f"{p}.attention.output.LayerNorm", y)
        h = _mlp(g, c, p, y, "intermediate.dense", "output.dense")
        h = _dropout(g, c.dropout, f"{p}.output.dropout", h)
        y = g(L.Add(), f"{p}.output.add", y, h)
        y = g(L.LayerNorm(c.dim, c.eps), f"{p}.output.LayerNorm", y)
    t = "cls.predictions.transform"
    y = g(L.Linear(c.dim, c.dim), f"{t}.dense", y)
    y = g(L.GELU(approximate=c.gelu), f"{t}.gelu", y)
    y = g(L.LayerNorm(c.dim, c.eps), f"{t}.LayerNorm", y)
    y = g(L.Linear(c.dim, c.vocab), "cls.predictions.decoder", y,
          names={"weight": f"{e}.word_embeddings.weight", "bias": "cls.predictions.bias"})
    net = Network(x, y, name=name, seed=seed, dtype=dtype)
    net.vocab_size = c.vocab
    return net


def transformer(name: str, seq_len: int | None = None, vocab: int | None = None,
                width: int | None = None, seed: int = 0, dtype: str = "float32") -> Network:
    """The model ``name`` of :data:`CONFIGS` with its context set to ``seq_len`` (the
    positional table's rows), its vocabulary to ``vocab`` and its width to ``width`` (a
    multiple of the heads) where given."""
    if name not in CONFIGS:
        raise ValueError(f"unknown transformer {name!r}; valid: {', '.join(CONFIGS)}")
    c = CONFIGS[name]
    changes = {k: v for k, v in (("context", seq_len), ("vocab", vocab), ("dim", width))
               if v is not None}
    c = replace(c, **changes)
    build = bert if name.startswith("bert") else gpt
    return build(c, name=name, seed=seed, dtype=dtype)
