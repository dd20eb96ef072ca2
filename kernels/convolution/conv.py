"""2-D convolution (NCHW, PyTorch weight layout): NumPy reference and Numba CPU kernels.

Three CPU algorithms (:func:`choose_algo`), all working image by image so that buffers stay
in cache:

* ``gemm`` (any geometry): im2col of one image (and group) into a ``(Cin/g*kh*kw, Ho*Wo)``
  buffer, then one matrix product with the weight written straight into the NCHW output
  (Numba's ``np.dot``, i.e. BLAS). Backward recomputes the im2col (only the input is
  retained), accumulates ``dW += dY_n @ col.T`` and, when the input gradient is wanted,
  scatters ``dcol = W.T @ dY_n`` back with col2im.
* ``winograd4`` (3x3, stride 1, one group, enough channels, planes of 4x4 or more):
  F(4x4, 3x3), see :mod:`minidl.kernels.convolution.winograd4`; 4x fewer multiplications.
* ``winograd`` (the same on smaller planes): F(2x2, 3x3), see
  :mod:`minidl.kernels.convolution.winograd`; 2.25x fewer multiplications.

The batch is cut into blocks of images multiplied together (block boundaries at multiples of
the block size, whatever the thread count) and the blocks are shared out over
:func:`~minidl.kernels.parallel.num_threads` threads (one ``prange`` iteration each, each thread
on its own row of the workspace). Weight and bias gradients are summed over :data:`GRAD_PARTS`
fixed runs of blocks, each into its own partial, then added in order. Every matrix product and
every sum therefore has the same shape and order for any thread count: results are
bit-identical across thread counts (on one machine: BLAS kernels differ between CPU models).
Small calls run on the calling thread.

Under a workspace cap (``max_workspace``, the ``conv_ws`` option of the plan) the call runs
the configuration :func:`conv_config` picks: the fastest whose workspace fits (im2col rather
than Winograd, fewer images per product, i.e. a smaller sub-batch at a time, bands of output
rows, one gradient part, fewer threads' rows), down to one output row of one image. Another
configuration sums in another order (results equal to float32 rounding); for one cap, the
bits still never depend on the thread count. A direct (no im2col) kernel
for one-input-channel layers was measured slower than im2col + GEMM (conv1 of smallcnn:
0.73 / 1.6 ms against 0.47 / 0.51 ms forward / backward) and was dropped.
"""

from __future__ import annotations

import numpy as np

from .. import _cuda
from ..parallel import ensure_blas_policy, num_threads
from .conv_call import cut_workspace
from .conv_device import (
    check_conv_shapes,
    conv2d_backward_device,
    conv2d_device_workspace_bytes,
    conv2d_forward_device,
)
from .conv_device_half import (
    conv2d_backward_device_half,
    conv2d_device_half_workspace_bytes,
    conv2d_forward_device_half,
    half_operands,
    is_half_dtype,
)
from .conv_geometry import (
    GEMM_MAX_COL_BYTES,
    GEMM_MIN_COLS,
    GRAD_PARTS,
    LEAN_COL_BYTES,
    MAX_THREADS,
    WINOGRAD_KERNELS,
    WINOGRAD_MAX_IMAGE_BYTES,
    WINOGRAD_MAX_WEIGHTS,
    WINOGRAD_MIN_CIN,
    WINOGRAD_MIN_TILES,
    ConvConfig,
    HostCall,
    Pair,
    block_bounds,
    choose_algo,
    conv2d_workspace_bytes,
    conv_config,
    conv_output_hw,
    grad_parts,
    host_call,
)
from .conv_numba import BWD_GEMM, FWD_GEMM, col2im, im2col
from .conv_ref import conv2d_backward_ref, conv2d_forward_ref, im2col_ref

# the geometry, reference and Numba kernels live in conv_geometry, conv_ref and conv_numba;
# their public names stay importable from here
__all__ = [
    "GEMM_MAX_COL_BYTES", "GEMM_MIN_COLS", "GRAD_PARTS", "LEAN_COL_BYTES", "MAX_THREADS",
    "SERIAL_MACS", "WINOGRAD_MAX_IMAGE_BYTES", "WINOGRAD_MAX_WEIGHTS", "WINOGRAD_MIN_CIN",
    "WINOGRAD_MIN_TILES", "ConvConfig", "Pair", "block_bounds", "choose_algo", "col2im",
    "conv2d_backward", "conv2d_backward_device", "conv2d_backward_ref",
    "conv2d_device_half_workspace_bytes", "conv2d_device_workspace_bytes", "conv2d_forward",
    "conv2d_forward_device", "conv2d_forward_ref", "conv2d_workspace_bytes", "conv_config",
    "conv_output_hw", "grad_parts", "im2col", "im2col_ref", "is_half_dtype",
]


# ----------------------------------------------------------------------------- drivers
def _c(a: np.ndarray) -> np.ndarray:
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


#: Multiply-adds below which a call runs on the calling thread alone (~20-50 us of work).
SERIAL_MACS = 1 << 20


def _check(x, w, groups, stride, padding, dilation, **arrays) -> None:
    """Validate shapes before the kernels index blindly."""
    check_conv_shapes(x, w, groups, stride, padding, dilation, **arrays)


def _host_call(x, w, stride, padding, dilation, groups, backward, max_workspace, algo,
               threads, workspace) -> HostCall:
    """The call's :func:`~.conv_geometry.host_call` (made once per shapes and workspace)."""
    return host_call(x.shape, w.shape[0], w.shape[2:], tuple(stride), tuple(padding),
                     tuple(dilation), groups, x.dtype.itemsize, backward, max_workspace, algo,
                     threads, min(num_threads(), MAX_THREADS),
                     None if workspace is None else workspace.nbytes, SERIAL_MACS)


def _on_device(*arrays) -> bool:
    """Device arrays take :mod:`.conv_device`'s path (host and device mixed: ``TypeError``)."""
    return _cuda.choose("auto", *arrays) == "cuda"


def conv2d_forward(
    x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, stride: Pair = (1, 1),
    padding: Pair = (0, 0), dilation: Pair = (1, 1), groups: int = 1,
    workspace: np.ndarray | None = None, threads: int | None = None, algo: str | None = None,
    max_workspace: int | None = None,
) -> None:
    """Write ``conv2d(x, w) + b`` into ``y`` (NCHW). ``workspace``: ``uint8`` of at least
    :func:`conv2d_workspace_bytes` (``backward=False``, the same ``max_workspace``); ``None``
    allocates one. ``algo`` (``"gemm"`` / ``"winograd"`` / ``"winograd4"``) overrides
    :func:`choose_algo`; ``max_workspace`` (bytes) runs the configuration :func:`conv_config`
    picks under that cap.
    Device arrays run :func:`~.conv_device.conv2d_forward_device` (workspace:
    :func:`~.conv_device.conv2d_device_workspace_bytes`; ``threads`` and ``algo`` unused)."""
    if _on_device(x, w, b, y, workspace):
        if half_operands(x, w):  # (mixed precision: half operands)
            conv2d_forward_device_half(x, w, b, y, stride, padding, dilation, groups,
                                       workspace, max_workspace)
            return
        conv2d_forward_device(x, w, b, y, stride, padding, dilation, groups, workspace,
                              max_workspace)
        return
    ensure_blas_policy()
    _check(x, w, groups, stride, padding, dilation, y=y, b=b)
    cout, cg, kh, kw = w.shape
    call = _host_call(x, w, stride, padding, dilation, groups, False, max_workspace, algo,
                      threads, workspace)
    slabs, _ = cut_workspace(workspace, call, x.dtype)
    offs, nb, bounds = call.offs, call.nb, call.bounds
    x, w = _c(x), _c(w)
    out = y if y.flags.c_contiguous else np.empty(y.shape, y.dtype)
    has_bias = b is not None
    bb = _c(b) if has_bias else np.zeros(0, x.dtype)
    if call.config.algo in WINOGRAD_KERNELS:
        kernel = WINOGRAD_KERNELS[call.config.algo].FORWARD
        args = (x, w, bb, has_bias, out, slabs, offs, bounds, nb, *padding)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        kernel = FWD_GEMM
        args = (x, w3, bb, has_bias, out, slabs, offs, bounds, nb, call.band, call.pitch, kh,
                kw, *stride, *padding, *dilation)
    kernel.run(bounds.size - 1, *args)  # one run of blocks per thread (one if serial)
    if out is not y:
        y[...] = out


def conv2d_backward(
    x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None, dw: np.ndarray,
    db: np.ndarray | None, stride: Pair = (1, 1), padding: Pair = (0, 0),
    dilation: Pair = (1, 1), groups: int = 1, workspace: np.ndarray | None = None,
    threads: int | None = None, algo: str | None = None, accumulate: bool = False,
    accumulate_bias: bool | None = None, max_workspace: int | None = None,
) -> None:
    """Overwrite ``dw``, ``db`` (if given) and ``dx`` (if given) with the gradients of
    :func:`conv2d_forward`; with ``accumulate``, add into ``dw`` and ``db`` instead (``dx`` is
    still overwritten); ``accumulate_bias`` (default: ``accumulate``) decides for ``db`` alone.
    ``workspace``: :func:`conv2d_workspace_bytes`, ``backward=True`` (the same
    ``max_workspace``, as in :func:`conv2d_forward`). Device arrays run
    :func:`~.conv_device.conv2d_backward_device`."""
    if _on_device(x, w, dy, dx, dw, db, workspace):
        if half_operands(x, w) and dy.dtype == x.dtype:
            conv2d_backward_device_half(x, w, dy, dx, dw, db, stride, padding, dilation,
                                        groups, workspace, accumulate, accumulate_bias,
                                        max_workspace)
            return
        conv2d_backward_device(x, w, dy, dx, dw, db, stride, padding, dilation, groups,
                               workspace, accumulate, accumulate_bias, max_workspace)
        return
    if db is not None and accumulate_bias is not None and accumulate_bias != accumulate:
        # a shared bias beside an unshared weight, or the reverse: the bias on its own
        conv2d_backward(x, w, dy, dx, dw, None, stride, padding, dilation, groups, workspace,
                        threads, algo, accumulate, max_workspace=max_workspace)
        sums = dy.sum(axis=(0, 2, 3), dtype=db.dtype)
        if accumulate_bias:
            db += sums
        else:
            db[...] = sums
        return
    ensure_blas_policy()
    _check(x, w, groups, stride, padding, dilation, dy=dy, dx=dx, dw=dw, db=db)
    cout, cg, kh, kw = w.shape
    call = _host_call(x, w, stride, padding, dilation, groups, True, max_workspace, algo,
                      threads, workspace)
    slabs, (dbparts, dwparts) = cut_workspace(workspace, call, x.dtype)
    offs, nb, bounds, parallel, algo = call.offs, call.nb, call.bounds, call.parallel, \
        call.config.algo
    x, w, dy = _c(x), _c(w), _c(dy)
    need_dx = dx is not None
    dxo = (dx if dx.flags.c_contiguous else np.empty(dx.shape, dx.dtype)) if need_dx else \
        np.zeros((0, 0, 0, 0), x.dtype)
    dwo = dw if dw.flags.c_contiguous else np.empty(dw.shape, dw.dtype)
    dbo = db if db is not None else np.zeros(cout, x.dtype)
    add = bool(accumulate)
    if add and dwo is not dw:
        dwo[...] = dw
    if algo in WINOGRAD_KERNELS:
        kernels = WINOGRAD_KERNELS[algo]
        args = (x, w, dy, dxo, need_dx, slabs, offs, dwparts, dbparts, bounds, nb, *padding)
        kernels.BACKWARD.run(slabs.shape[0] if parallel else 1, *args)
        kernels.finish_grads(dwparts, dbparts, dwo, dbo, add)
    else:
        w3 = w.reshape(groups, cout // groups, cg * kh * kw)
        dwf = dwo.reshape(-1)
        args = (x, w3, dy, dxo, need_dx, slabs, offs, dwf, add, dwparts, dbparts, bounds, nb,
                call.band, call.pitch, kh, kw, *stride, *padding, *dilation)
        BWD_GEMM.run(slabs.shape[0] if parallel else 1, *args)
        for part in dwparts:  # the first part went straight into dw; the others, in order
            dwf += part[: dwf.size]
        if not add:
            dbo[...] = dbparts[0, :cout]
        for part in dbparts[1 - add:]:
            dbo += part[:cout]
    if dwo is not dw:
        dw[...] = dwo
    if need_dx and dxo is not dx:
        dx[...] = dxo
