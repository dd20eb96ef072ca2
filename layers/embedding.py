"""Embedding: integer indices of any shape (N, ...) -> rows of ``weight``, (N, ..., dim)."""

from __future__ import annotations

import numpy as np

from ..kernels.embedding import embedding_backward
from .base import Layer, ParamSpec


class Embedding(Layer):
    """A lookup table ``weight`` (num_embeddings, embedding_dim), initialised N(0, 1) as in
    PyTorch. The output dtype is the weight dtype, which the contract cannot see from the
    (integer) input: pass ``dtype`` (default float32) to match the parameters' dtype.
    Backward scatter-adds into the weight gradient; the indices get no gradient."""

    kind = "embedding"
    retain_inputs = (0,)
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
        self._check_index_dtype(np.dtype(in_dtypes[0]))
        return [self.dtype]

    def param_specs(self):
        return {"weight": ParamSpec((self.num_embeddings, self.embedding_dim), "normal")}

    def flops(self, in_shapes):
        return 0

    def _check_index_dtype(self, dt: np.dtype) -> None:
        if dt.kind not in "iu":
            raise TypeError(
                f"layer {self.name or 'Embedding'} ({self.describe()}) takes integer indices, "
                f"got dtype {dt}"
            )

    def _check_range(self, idx: np.ndarray) -> None:
        if idx.size == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.num_embeddings:
            bad = lo if lo < 0 else hi
            raise IndexError(
                f"layer {self.name or 'Embedding'} ({self.describe()}): index {bad} out of "
                f"range for a vocabulary of size {self.num_embeddings}"
            )

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        idx = inputs[0]
        self._check_index_dtype(idx.dtype)
        self._check_range(idx)
        w, y = params["weight"], outputs[0]
        if w.dtype != y.dtype:
            raise TypeError(
                f"layer {self.name or 'Embedding'} ({self.describe()}): weight dtype {w.dtype} "
                f"differs from the declared output dtype {y.dtype} (pass dtype=...)"
            )
        # mode="clip" is unbuffered (mode="raise" would buffer the output); range checked above.
        np.take(w, idx, axis=0, out=y, mode="clip")

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        gw = grad_params.get("weight")
        if gw is None:
            return
        dy = grad_outputs[0].reshape(-1, self.embedding_dim)
        idx = inputs[0].reshape(-1)
        if isinstance(gw, np.ndarray) and gw.flags.c_contiguous:
            embedding_backward(idx, dy, gw)
        else:
            gw.fill(0)
            np.add.at(gw, idx, dy)

    def describe(self) -> str:
        return f"Embedding({self.num_embeddings}, {self.embedding_dim})"


