"""Embedding: integer indices of any shape (N, ...) -> rows of ``weight``, (N, ..., dim)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels.transformer.embedding import embedding_accumulate, embedding_backward, take_rows
from ...kernels.vocabulary import RecomputeCost
from ..base import Layer, ParamSpec


def check_integer_dtype(layer: Layer, dt: Any, what: str) -> None:
    """TypeError naming ``layer`` unless ``dt`` is an integer dtype (``what``: "indices")."""
    if np.dtype(dt).kind not in "iu":
        raise TypeError(f"layer {layer.name or type(layer).__name__} ({layer.describe()}) "
                        f"takes integer {what}, got dtype {np.dtype(dt)}")


def check_index_range(layer: Layer, idx: np.ndarray, size: int, what: str) -> None:
    """IndexError naming ``layer`` and the first offending value unless every entry of
    ``idx`` is in [0, size) (``what``: "index", "token"). Device arrays are not read (that
    would wait for the device): the executor checks them on the host before the upload
    (:meth:`~minidl.layers.base.Layer.check_feed`)."""
    if idx.size == 0 or not isinstance(idx, np.ndarray):
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        raise IndexError(f"layer {layer.name or type(layer).__name__} ({layer.describe()}): "
                         f"{what} {lo if lo < 0 else hi} out of range for a vocabulary of "
                         f"size {size}")


class Embedding(Layer):
    """A lookup table ``weight`` (num_embeddings, embedding_dim), initialised N(0, 1) as in
    PyTorch. The output dtype is the weight dtype, which the contract cannot see from the
    (integer) input: pass ``dtype`` (default float32) to match the parameters' dtype.
    Backward scatter-adds into the weight gradient; the indices get no gradient."""

    kind = "embedding"
    recompute_cost = RecomputeCost.EXPENSIVE
    retain_inputs = (0,)
    accumulates_grads = True
    nondiff_inputs = (0,)

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype=np.float32) -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                f"Embedding needs positive sizes, got ({num_embeddings}, {embedding_dim})"
            )
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.dtype = np.dtype(dtype)

    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        if len(s) < 1:
            raise self.shape_error("indices (N, ...)", tuple(s))
        return [(*s, self.embedding_dim)]

    def output_dtypes(self, in_dtypes):
        check_integer_dtype(self, in_dtypes[0], "indices")
        return [self.dtype]

    def param_specs(self):
        return {"weight": ParamSpec((self.num_embeddings, self.embedding_dim), "normal")}

    def flops(self, in_shapes):
        return 0

    def check_feed(self, index, host, in_shapes) -> None:
        check_index_range(self, host, self.num_embeddings, "index")

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        idx = inputs[0]
        check_integer_dtype(self, idx.dtype, "indices")
        check_index_range(self, idx, self.num_embeddings, "index")
        w, y = params["weight"], outputs[0]
        if w.dtype != y.dtype:
            raise TypeError(
                f"layer {self.name or 'Embedding'} ({self.describe()}): weight dtype {w.dtype} "
                f"differs from the declared output dtype {y.dtype} (pass dtype=...)"
            )
        take_rows(w, idx, y)  # range checked above

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        gw = grad_params.get("weight")
        if gw is None:
            return
        dy = grad_outputs[0].reshape(-1, self.embedding_dim)
        idx = inputs[0].reshape(-1)
        if "weight" in ctx.accumulate:
            embedding_accumulate(idx, dy, gw)
        else:
            embedding_backward(idx, dy, gw)

    def describe(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"


