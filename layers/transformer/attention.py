"""MultiHeadAttention: self-attention on (N, T, D) with a fused q|k|v projection, whose memory
form (probabilities kept, or blockwise with only the log-sum-exp kept) is an option of the plan.
"""

from __future__ import annotations

import numpy as np

from ...kernels.transformer import attention as ak
from ...kernels.vocabulary import RecomputeCost
from ..base import Layer, ParamSpec
from ..linear import linear_backward, linear_forward

#: This layer's parameter names -> nanoGPT's ``CausalSelfAttention`` (``c_attn``, ``c_proj``).
NANOGPT_NAMES = {"qkv.weight": "c_attn.weight", "qkv.bias": "c_attn.bias",
                 "proj.weight": "c_proj.weight", "proj.bias": "c_proj.bias"}
#: This layer's parameter names -> ``torch.nn.MultiheadAttention``'s (``batch_first=True``).
NN_MULTIHEAD_NAMES = {"qkv.weight": "in_proj_weight", "qkv.bias": "in_proj_bias",
                      "proj.weight": "out_proj.weight", "proj.bias": "out_proj.bias"}

#: Elements of the attention matrix (B*H*T*T) the dropout hash can index.
_MAX_DROPOUT_ELEMS = 1 << 32


class MultiHeadAttention(Layer):
    """Self-attention: ``qkv = x @ qkv.weight.T + qkv.bias`` (q, k, v each ``dim`` wide, split
    into ``heads`` heads), ``softmax(q k^T / sqrt(dim / heads))`` (``causal``: each position
    attends to itself and earlier ones), dropout ``dropout`` on the probabilities in training,
    heads concatenated, then ``proj``. Parameters (PyTorch layouts): ``qkv.weight`` (3D, D),
    ``qkv.bias`` (3D,), ``proj.weight`` (D, D), ``proj.bias`` (D,), initialised as
    ``nn.Linear``. They map one to one onto nanoGPT's ``c_attn`` / ``c_proj``
    (:data:`NANOGPT_NAMES`) and ``nn.MultiheadAttention``'s ``in_proj_*`` / ``out_proj.*``
    (:data:`NN_MULTIHEAD_NAMES`), the same q|k|v order and head split.

    Memory: the per-op option ``"attn"`` (:func:`~minidl.kernels.transformer.attention.parse_form`)
    set by
    the plan: ``"keep"`` (the default) stashes the probabilities (N, H, T, T);
    ``"blockwise:<n>"`` stashes only the row log-sum-exp (N, H, T) and recomputes n x n tiles
    of probabilities in backward (FlashAttention); both stash ``qkv`` (N, T, 3D) and the
    heads' output (N, T, D) and retain the input. Workspaces per form:
    :func:`~minidl.kernels.transformer.attention.forward_layout` / ``backward_layout``. Dropout
    masks
    hash (``ctx.seed``, position in the attention matrix): identical in both forms and when a
    step is recomputed.
    """

    kind = "attention"
    recompute_cost = RecomputeCost.EXPENSIVE
    retain_inputs = (0,)
    accumulates_grads = True
    option_names = ("attn",)

    def __init__(self, dim: int, heads: int, causal: bool = False, dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        if dim < 1 or heads < 1 or dim % heads:
            raise ValueError(f"MultiHeadAttention needs dim divisible by heads, both positive; "
                             f"got dim={dim}, heads={heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
        self.dim, self.heads = int(dim), int(heads)
        self.causal, self.dropout, self.bias = bool(causal), float(dropout), bool(bias)

    # ----------------------------------------------------------------- declarations
    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) != 3 or s[2] != self.dim or s[1] < 1:
            raise self.shape_error(f"(N, T, {self.dim})", tuple(s))
        return [tuple(s)]

    def param_specs(self):
        d = self.dim
        specs = {"qkv.weight": ParamSpec((3 * d, d), "uniform", fan_in=d)}
        if self.bias:
            specs["qkv.bias"] = ParamSpec((3 * d,), "uniform", fan_in=d)
        specs["proj.weight"] = ParamSpec((d, d), "uniform", fan_in=d)
        if self.bias:
            specs["proj.bias"] = ParamSpec((d,), "uniform", fan_in=d)
        return specs

    def _geometry(self, in_shapes, options) -> tuple[int, int, int | None]:
        b, t, _ = self.output_shapes(in_shapes)[0]
        return b, t, ak.parse_form((options or {}).get("attn"))

    def stash_specs(self, in_shapes, dtype, options=None):
        b, t, block = self._geometry(in_shapes, options)
        dt = np.dtype(dtype)
        lse = np.dtype(np.float32) if dt.itemsize < 4 else dt  # a statistic: float32 in half
        return {k: (s, lse if k == "lse" else dt) for k, s in
                ak.stash_shapes(b, t, self.dim, self.heads, block).items()}

    def forward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        b, t, block = self._geometry(in_shapes, options)
        return ak.forward_layout(b, t, self.dim, self.heads, block,
                                 self.dropout > 0).nbytes(dtype)

    def backward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        b, t, block = self._geometry(in_shapes, options)
        return ak.backward_layout(b, t, self.dim, self.heads, block,
                                  self.dropout > 0).nbytes(dtype)

    def memory_attrs(self, in_shapes) -> dict:
        b, t, _ = self.output_shapes(in_shapes)[0]
        return {"attention": {"batch": b, "seq": t, "dim": self.dim, "heads": self.heads,
                              "causal": self.causal, "dropout": self.dropout > 0}}

    def flops(self, in_shapes):
        b, t, d = self.output_shapes(in_shapes)[0]
        pairs = t * (t + 1) // 2 if self.causal else t * t
        return 2 * b * t * d * 4 * d + 4 * b * pairs * d

    # ----------------------------------------------------------------- compute
    def _p_drop(self, ctx, shape) -> float:
        if not ctx.training or self.dropout == 0.0:
            return 0.0
        b, t, _ = shape
        if (ctx.batch_offset + b) * self.heads * t * t > _MAX_DROPOUT_ELEMS:
            raise ValueError(f"layer {self.name or 'MultiHeadAttention'}: attention dropout "
                             f"hashes 32-bit positions; {b}x{self.heads}x{t}x{t} is too many")
        return self.dropout

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x, y = inputs[0], outputs[0]
        b, t, d = x.shape
        block = ak.parse_form(ctx.options.get("attn"))
        qkv, attn = stash["qkv"], stash["attn"]
        linear_forward(x.reshape(-1, d), params["qkv.weight"], params.get("qkv.bias"),
                       qkv.reshape(-1, 3 * d))
        layout = ak.forward_layout(b, t, d, self.heads, block, self.dropout > 0)
        ws = layout.carve(workspace, x.dtype) if layout.entries else None
        saved = stash["probs"] if block is None else stash["lse"]
        ak.attention_forward(qkv, attn, saved, self.heads, self.causal,
                             self._p_drop(ctx, x.shape), ctx.seed, ws, block,
                             ctx.batch_offset)
        linear_forward(attn.reshape(-1, d), params["proj.weight"], params.get("proj.bias"),
                       y.reshape(-1, d))

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        x, dy, dx = inputs[0], grad_outputs[0], grad_inputs[0]
        b, t, d = x.shape
        block = ak.parse_form(ctx.options.get("attn"))
        ws = ak.backward_layout(b, t, d, self.heads, block, self.dropout > 0).carve(
            workspace, x.dtype)
        qkv, attn = stash["qkv"], stash["attn"]
        linear_backward(dy.reshape(-1, d), attn.reshape(-1, d), params["proj.weight"],
                        ws.dattn.reshape(-1, d), grad_params, ctx, "proj.")
        saved = stash["probs"] if block is None else stash["lse"]
        ak.attention_backward(ws.dattn, qkv, attn, saved, ws.dqkv, self.heads, self.causal,
                              self._p_drop(ctx, x.shape), ctx.seed, ws, block,
                              ctx.batch_offset)
        linear_backward(ws.dqkv.reshape(-1, 3 * d), x.reshape(-1, d), params["qkv.weight"],
                        None if dx is None else dx.reshape(-1, d), grad_params, ctx, "qkv.")

    def describe(self) -> str:
        extra = ", causal=True" if self.causal else ""
        if self.dropout:
            extra += f", dropout={self.dropout:g}"
        if not self.bias:
            extra += ", bias=False"
        return f"MultiHeadAttention({self.dim}, heads={self.heads}{extra})"

