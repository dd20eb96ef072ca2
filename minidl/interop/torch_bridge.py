"""An equivalent PyTorch module for a minidl network (benchmarks and reference tests only).

PyTorch is never a dependency of minidl: this module imports it lazily and is used by
``minidl bench --compare-torch`` and by tests that compare against PyTorch when it is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import layers as L
from ..net.graph import Network
from ..zoo.rnn import SequenceModel

#: ``(minidl layer classes, build)`` in the order they are tried (a subclass takes the first
#: entry it matches); ``build(nn, attr, torch)`` makes the ``torch.nn`` module from the layer's
#: attributes (``attr(name, default=None)``), or None for the parameter-free joins the graph
#: module computes inline.
_TORCH_MODULES: tuple[tuple[Any, Callable[[Any, Callable[..., Any], Any], Any]], ...] = (
    (L.Conv2d, lambda nn, g, torch: nn.Conv2d(
        g("in_channels"), g("out_channels"), g("kernel_size"), g("stride"), g("padding"),
        g("dilation"), g("groups"), bias=bool(g("has_bias", g("bias"))))),
    (L.Linear, lambda nn, g, torch: nn.Linear(g("in_features"), g("out_features"),
                                              bias=bool(g("bias")))),
    (L.BatchNorm1d, lambda nn, g, torch: _batchnorm(nn.BatchNorm1d, g)),
    (L.BatchNorm2d, lambda nn, g, torch: _batchnorm(nn.BatchNorm2d, g)),
    (L.MaxPool2d, lambda nn, g, torch: nn.MaxPool2d(g("kernel_size"), g("stride"),
                                                    g("padding"))),
    (L.AvgPool2d, lambda nn, g, torch: nn.AvgPool2d(g("kernel_size"), g("stride"),
                                                    g("padding"))),
    (L.LeakyReLU, lambda nn, g, torch: nn.LeakyReLU(g("negative_slope"))),
    (L.ReLU, lambda nn, g, torch: nn.ReLU()),
    (L.Sigmoid, lambda nn, g, torch: nn.Sigmoid()),
    (L.Tanh, lambda nn, g, torch: nn.Tanh()),
    (L.Dropout, lambda nn, g, torch: nn.Dropout(g("p"))),
    (L.Flatten, lambda nn, g, torch: nn.Flatten(g("start_dim", 1), g("end_dim", -1))),
    (L.Embedding, lambda nn, g, torch: nn.Embedding(g("num_embeddings"), g("embedding_dim"))),
    (L.LayerNorm, lambda nn, g, torch: nn.LayerNorm(g("dim"), eps=g("eps"))),
    (L.GELU, lambda nn, g, torch: nn.GELU(approximate=g("approximate"))),
    (L.PositionalEmbedding, lambda nn, g, torch: _positions(torch, g("context"), g("dim"))),
    (L.MultiHeadAttention, lambda nn, g, torch: torch_self_attention(
        torch, g("dim"), g("heads"), g("causal"), g("dropout"), g("bias"))),
    ((L.Add, L.Concat, L.GlobalAvgPool2d), lambda nn, g, torch: None),
)


def _module_for(layer: Any, torch: Any) -> Any:
    """The ``torch.nn`` module computing ``layer`` (``None`` for the parameter-free joins the
    graph module computes inline), chosen by the layer's class (subclasses included)."""
    g = lambda name, default=None: getattr(layer, name, default)  # noqa: E731
    for classes, build in _TORCH_MODULES:
        if isinstance(layer, classes):
            return build(torch.nn, g, torch)
    raise NotImplementedError(f"no PyTorch equivalent for layer {type(layer).__name__}")


def _batchnorm(cls: Any, g: Callable[..., Any]) -> Any:
    """``cls`` (``nn.BatchNorm1d`` / ``2d``) with the layer's features, eps, momentum, affine
    and running statistics."""
    return cls(g("num_features"), eps=g("eps"), momentum=g("momentum"), affine=g("affine"),
               track_running_stats=g("track_running_stats"))


def _positions(torch: Any, context: int, dim: int) -> Any:
    """``x + weight[:T]`` (minidl's PositionalEmbedding; nanoGPT's ``wpe`` added)."""

    class Positions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(context, dim))

        def forward(self, x: Any) -> Any:
            return x + self.weight[: x.shape[1]]

    return Positions()


def torch_self_attention(torch: Any, dim: int, heads: int, causal: bool, dropout: float,
                         bias: bool) -> Any:
    """A PyTorch module equal to :class:`~minidl.layers.MultiHeadAttention` of the
    same arguments: nanoGPT's self-attention with minidl's parameter names (``qkv``,
    ``proj``), through ``scaled_dot_product_attention`` (dropout on the probabilities in
    training). ``torch`` is the imported module (it is never a dependency of minidl)."""
    F = torch.nn.functional

    class SelfAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(dim, 3 * dim, bias=bias)
            self.proj = torch.nn.Linear(dim, dim, bias=bias)

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = (a.view(b, t, heads, d // heads).transpose(1, 2)
                       for a in self.qkv(x).split(d, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                               dropout_p=dropout if self.training else 0.0)
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    return SelfAttention()


def _char_rnn_to_torch(net: Any) -> Any:
    """Embedding → nn.LSTM/nn.GRU (batch first) → Linear, with the model's weights (the
    parameter names are PyTorch's, so the state dict loads as is)."""
    import torch

    state = net.state_dict()
    cell = "lstm" if "lstm.weight_ih_l0" in state else "gru"
    vocab, emb = state["embedding.weight"].shape
    hidden = state[f"{cell}.weight_hh_l0"].shape[1]
    layers = sum(1 for k in state if k.startswith(f"{cell}.weight_ih_l"))

    class CharRNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab, emb)
            rnn = torch.nn.LSTM if cell == "lstm" else torch.nn.GRU
            setattr(self, cell, rnn(emb, hidden, layers, batch_first=True))
            self.fc = torch.nn.Linear(hidden, state["fc.weight"].shape[0])

        def forward(self, x: Any) -> Any:
            y, _ = getattr(self, cell)(self.embedding(x))
            return self.fc(y)

    m = CharRNN()
    m.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    return m


def to_torch(net: Network) -> Any:
    """A ``torch.nn.Module`` computing the same function as ``net``, with its weights copied."""
    import torch

    if isinstance(net, SequenceModel):
        return _char_rnn_to_torch(net)

    class GraphModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mods = torch.nn.ModuleDict()
            self.plan: list[tuple[str, Any, list[int], int]] = []
            shared: dict[int, Any] = {}  # a parameter several layers use (tied weights)
            for node in net.nodes:
                key = node.name.replace(".", "_")
                m = _module_for(node.layer, torch)
                if m is not None:
                    self.mods[key] = m
                    with torch.no_grad():
                        for pname, p in net.layer_params(node.name).items():
                            owner, _, local = pname.rpartition(".")
                            owner = m.get_submodule(owner) if owner else m
                            if id(p) in shared:
                                setattr(owner, local, shared[id(p)])
                                continue
                            theirs = getattr(owner, local)
                            theirs.copy_(torch.from_numpy(np.asarray(p.data)))
                            shared[id(p)] = theirs
                self.plan.append((key, node.layer, node.in_values, node.out_values[0]))
            self.n_values = len(net.values)
            self.out_values = list(net.output_values)

        def forward(self, *xs: Any) -> Any:
            vals: list[Any] = [None] * self.n_values
            for i, x in enumerate(xs):
                vals[i] = x
            for key, layer, ins, out in self.plan:
                args = [vals[v] for v in ins]
                if isinstance(layer, L.Add):
                    y = args[0]
                    for a in args[1:]:
                        y = y + a
                elif isinstance(layer, L.Concat):
                    y = torch.cat(args, dim=layer.axis)
                elif isinstance(layer, L.GlobalAvgPool2d):
                    y = args[0].mean(dim=(2, 3))
                else:
                    y = self.mods[key](*args)
                vals[out] = y
            outs = [vals[v] for v in self.out_values]
            return outs[0] if len(outs) == 1 else tuple(outs)

    return GraphModule()
