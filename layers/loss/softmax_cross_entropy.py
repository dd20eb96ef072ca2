"""SoftmaxCrossEntropy: mean cross-entropy of softmax(logits) against integer class targets."""

from __future__ import annotations

import math

import numpy as np

from ...kernels import _cuda
from ...kernels.array_api import is_half_dtype, namespace, round_into
from ...kernels.pointwise import softmax_xent
from ...kernels.vocabulary import DeviceKind
from ..base import Layer, device_kind

#: Elements per chunk of the forward pass (bounds its workspace).
_CHUNK = 1 << 16
#: Elements of half logits (and their gradient) made float32 at a time on a device.
HALF_BLOCK = 1 << 22
_F32 = np.dtype(np.float32)


def _block_bytes(elems: int) -> int:
    """Bytes of a float32 block of ``elems``, rounded up to 256 (the buffers after it stay
    aligned)."""
    return -(-elems * _F32.itemsize // 256) * 256


class SoftmaxCrossEntropy(Layer):
    """Inputs: logits (N, K) or (N, ..., K) (classes on the *last* axis) and integer targets
    of the leading shape (N,) or (N, ...); output: the scalar mean loss over all N*... rows.
    ``label_smoothing`` as PyTorch: the target distribution is (1 - eps) * onehot + eps / K.

    Memory: backward retains the logits and targets (no stashed probabilities): the forward
    computes log-sum-exp chunk by chunk in a workspace of about 65536 elements (provided by the
    engine) and backward rebuilds the softmax directly in the gradient array, so the layer
    never holds a second logits-sized array.

    On a GPU (CuPy arrays) forward and backward run the Numba CUDA kernels of
    :mod:`minidl.kernels.pointwise.softmax_xent`: two launches forward (the rows' float64 losses in
    its
    workspace) and one backward, no host synchronisation, no array of their own; their exp and
    sums are not NumPy's, so they agree with the CPU to rounding. Other device arrays (the
    strict test device's) run the host path's array operations (about 15 launches each way, a
    few per-row temporaries; the same operations, so their results equal the CPU's bit for
    bit), unless :attr:`device_kernels` says otherwise. The workspace of a ``"cuda"`` kind
    holds either.

    Half logits on a device (mixed precision) are made float32 a block of rows at a time in
    the workspace (:data:`HALF_BLOCK` elements; whole chunks of the forward's), and the
    gradient of a block is computed in float32 there and rounded once into the half gradient:
    row by row the same arithmetic as on a float32 copy of the whole logits.
    """

    kind = "loss"
    num_inputs = 2
    retain_inputs = (0, 1)
    nondiff_inputs = (1,)
    #: The forward workspace: logits chunks, or the kernels' rows' losses on a ``"cuda"``.
    option_names = ("device_kind",)
    #: Device arrays go to the CUDA kernels (True) or to the array operations (False); None:
    #: CuPy's arrays to the kernels, the strict test device's (emulated) to the operations.
    device_kernels: bool | None = None

    def __init__(self, label_smoothing: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)

    def output_shapes(self, in_shapes):
        logits, target = (tuple(s) for s in in_shapes)
        if len(logits) < 2 or logits[-1] < 1:
            raise self.shape_error("logits (N, ..., K)", logits)
        if target != logits[:-1]:
            raise self.shape_error(f"targets of shape {logits[:-1]} for logits {logits}", target)
        return [()]

    def output_dtypes(self, in_dtypes):
        t = np.dtype(in_dtypes[1])
        if t.kind not in "iu":
            raise TypeError(
                f"layer {self.name or 'SoftmaxCrossEntropy'} takes integer class targets, "
                f"got dtype {t}"
            )
        return [np.dtype(in_dtypes[0])]

    def flops(self, in_shapes):
        return 5 * math.prod(in_shapes[0])

    def _rows_per_chunk(self, in_shapes) -> int:
        k = in_shapes[0][-1]
        rows = math.prod(in_shapes[0][:-1])
        return max(1, min(rows, _CHUNK // k))

    def _half_block_rows(self, in_shapes) -> int:
        """Rows of half logits made float32 at a time: whole forward chunks, about
        :data:`HALF_BLOCK` elements."""
        k = in_shapes[0][-1]
        rows = math.prod(in_shapes[0][:-1])
        chunk = self._rows_per_chunk(in_shapes)
        return max(1, min(rows, max(chunk, HALF_BLOCK // k // chunk * chunk)))

    def stash_specs(self, in_shapes, dtype, options=None):
        return {}

    def backward_workspace_bytes(self, in_shapes, dtype, options=None):
        if is_half_dtype(dtype) and device_kind(options) == DeviceKind.CUDA:
            return 2 * _block_bytes(self._half_block_rows(in_shapes) * in_shapes[0][-1])
        return 0

    def forward_workspace_bytes(self, in_shapes, dtype, options=None):
        half = is_half_dtype(dtype) and device_kind(options) == DeviceKind.CUDA
        dt = _F32 if half else np.dtype(dtype)
        chunks = self._rows_per_chunk(in_shapes) * in_shapes[0][-1] * dt.itemsize
        if self.device_kernels is not False and \
                device_kind(options) == DeviceKind.CUDA:
            chunks = max(chunks, math.prod(in_shapes[0][:-1]) * 8)  # or float64 per row
        if half:  # (the block of logits made float32, then the chunks' buffer)
            return _block_bytes(self._half_block_rows(in_shapes) * in_shapes[0][-1]) + chunks
        return chunks

    def _kernels(self, a) -> bool:
        """Whether ``a`` (logits or their gradient) goes to the CUDA kernels."""
        if self.device_kernels is None:
            return _cuda.is_device_array(a) and not _cuda._emulated(a)
        return self.device_kernels and _cuda.is_device_array(a)

    def _check_targets(self, t: np.ndarray, k: int) -> None:
        if t.dtype.kind not in "iu":
            raise TypeError(f"{self.describe()} takes integer class targets, got {t.dtype}")
        if t.size == 0 or not isinstance(t, np.ndarray):
            return  # (device targets are checked on the host before the upload: check_feed)
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= k:
            raise IndexError(
                f"layer {self.name or 'SoftmaxCrossEntropy'} ({self.describe()}): target "
                f"{lo if lo < 0 else hi} out of range for {k} classes"
            )

    def check_feed(self, index, host, in_shapes) -> None:
        if index == 1:
            self._check_targets(host.reshape(-1), in_shapes[0][-1])

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        k = inputs[0].shape[-1]
        x = inputs[0].reshape(-1, k)
        t = inputs[1].reshape(-1)
        self._check_targets(t, k)
        m = x.shape[0]
        eps = self.label_smoothing
        blocks, ws = self._blocks(x, inputs[0].shape, workspace, 1)
        if self._kernels(x):
            if ws is None or ws.nbytes < 8 * m:
                ws = _cuda.empty(x, 8 * m, np.uint8)
            nll = _cuda.flat(ws, "workspace")[:8 * m].view(np.float64)
            for lo, xb, _ in blocks:
                softmax_xent.nll_rows_device(xb, t[lo:lo + xb.shape[0]], eps,
                                             nll[lo:lo + xb.shape[0]])
            softmax_xent.mean_device(nll, outputs[0])
            return
        rows = self._rows_per_chunk([inputs[0].shape])
        dt = _F32 if is_half_dtype(x.dtype) else x.dtype
        buf = ws[: rows * k * dt.itemsize].view(dt).reshape(rows, k)
        xp = namespace(x)
        total = 0.0  # a float64 sum, on x's device (no host synchronisation per chunk)
        for b0, xb, _ in blocks:
            for lo in range(0, xb.shape[0], rows):
                xc, tc = xb[lo:lo + rows], t[b0 + lo:b0 + lo + rows]
                b = buf[: xc.shape[0]]
                mx = xc.max(axis=1)
                np.subtract(xc, mx[:, None], out=b)
                np.exp(b, out=b)
                lse = np.log(b.sum(axis=1)) + mx
                nll = lse - xc[xp.arange(xc.shape[0]), tc]
                if eps:
                    nll = (1.0 - eps) * nll + eps * (lse - xc.mean(axis=1))
                total = total + nll.sum(dtype=np.float64)
        outputs[0][...] = total / m if m else np.nan

    def _blocks(self, x, shape, workspace, buffers: int):
        """``(blocks, rest of the workspace)``: blocks of ``(first row, logits rows, float32
        gradient rows or None)``: the whole logits at once, or for half logits on a device
        blocks made float32 in the workspace (``buffers`` float32 blocks: the logits', and
        with 2 the gradient's), each block's logits filled as it is reached."""
        if not (is_half_dtype(x.dtype) and _cuda.is_device_array(x)):
            return [(0, x, None)], workspace
        m, k = x.shape
        rows = self._half_block_rows([shape])
        size = _block_bytes(rows * k)
        flat = _cuda.flat(workspace, "workspace")
        bufs = [flat[i * size: i * size + rows * k * 4].view(_F32).reshape(rows, k)
                for i in range(buffers)]

        def gen():
            for lo in range(0, m, rows):
                n = min(rows, m - lo)
                xb = bufs[0][:n]
                np.copyto(xb, x[lo:lo + n])
                yield lo, xb, bufs[1][:n] if buffers > 1 else None
        return gen(), flat[buffers * size:]

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        dx = grad_inputs[0]
        if dx is None:
            return
        k = inputs[0].shape[-1]
        x = inputs[0].reshape(-1, k)
        t = inputs[1].reshape(-1)
        d = dx.reshape(-1, k)
        if not np.may_share_memory(d, dx):
            raise ValueError("SoftmaxCrossEntropy writes a C-contiguous gradient array only")
        m = x.shape[0]
        blocks, _ = self._blocks(x, inputs[0].shape, workspace, 2)
        for lo, xb, db in blocks:
            rows = xb.shape[0]
            out = d if db is None else db
            self._gradient(xb, t[lo:lo + rows], grad_outputs[0], out, m)
            if db is not None:  # (rounded once into the half gradient)
                round_into(d[lo:lo + rows], db)

    def _gradient(self, x, t, grad, d, m: int) -> None:
        """``d`` = the gradient of the mean loss over ``m`` rows for the rows ``x`` (with
        targets ``t``), times the 0-d upstream ``grad``; ``d`` may be ``x``."""
        eps = self.label_smoothing
        if self._kernels(d):
            softmax_xent.backward_device(x, t, grad, eps, d, m)
            return
        k = x.shape[1]
        scale = grad * (1.0 / max(m, 1))  # 0-d, in the logits dtype
        # softmax rebuilt in place in d: exp(x - max) / sum, times the upstream scale
        np.subtract(x, x.max(axis=1)[:, None], out=d)
        np.exp(d, out=d)
        d *= (scale / d.sum(axis=1))[:, None]
        if eps:
            d -= scale * (eps / k)
        d[namespace(d).arange(x.shape[0]), t] -= scale * (1.0 - eps)

    def describe(self) -> str:
        if self.label_smoothing:
            return f"SoftmaxCrossEntropy(label_smoothing={self.label_smoothing:g})"
        return "SoftmaxCrossEntropy()"
