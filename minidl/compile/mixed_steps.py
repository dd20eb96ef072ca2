"""A mixed-precision program's steps on the host (:mod:`~minidl.memory.ir.precision`).

Every tensor stays in the arena in its program dtype (bfloat16 as ``ml_dtypes.bfloat16``,
float16 as NumPy's), so the real peak is the dry run's. A layer computes in float32 on copies
cast up from its half arrays and its half outputs are rounded back into their blocks: the
numerics of PyTorch's CPU autocast (matrix products accumulate in float32 on half-rounded
operands and round their result once; losses, softmax and normalisation statistics in
float32). Each step of a matrix op rounds its weights to half itself
(``ForwardSlots.param_casts``: a cast is cheaper than keeping the copy from forward to
backward) and its float32 inputs into their cast copies, which its backward reads. Parameter
gradients are written straight into the float32 ``.grad`` (accumulated in float32; the
optimizer updates the float32 master weights).

On the CPU the float32 and rounded copies live on the host heap for the step, outside the
arena: the plan prices a device whose kernels read half operands directly (the rounded copies
in the step's workspace), and so does the dry run. On a CUDA device (and the strict test
device) they are staged in the step's workspace, which the lowering sizes for them
(:mod:`.mixed_staging`), never host arrays nor CuPy's own pool. The layers of
:data:`DEVICE_HALF_IO_KINDS` take every array as it is (their kernels round once from float32
or copy bits); those of :data:`DEVICE_HALF_OPERAND_KINDS` read their half operands
themselves (cuBLAS GemmEx with float32 compute, :func:`~minidl.kernels.device_gemm.gemm_ex`);
the others run their float32 device kernels on float32 copies, so the device computes what
the CPU does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..kernels._cuda import is_device_array
from ..kernels.array_api import is_half_dtype, round_into
from ..kernels.pooling.pool import maxpool_half_exact
from ..layers.loss.softmax_cross_entropy import SoftmaxCrossEntropy
from ..layers.pooling.pool import MaxPool2d
from ..memory.ir.precision import Precision, is_float
from ..memory.ir.program import Step
from .mixed_staging import Staging

#: Separates a tensor's stash key from the dtype of its cast copy (``weight@bfloat16``).
CAST_MARK = "@"
#: What a half op's matrix products run in: the mixed precisions' half dtypes.
HALF_MATMULS = frozenset(p.half_dtype for p in Precision if p.half_dtype is not None)
#: Layer kinds the host runs in mixed precision (tested against PyTorch's CPU autocast).
#: Attention computes its products and softmax in float32 on half-rounded inputs and weights
#: and keeps q|k|v, the heads' output and the probabilities in half (the row log-sum-exp in
#: float32); a fused recurrent layer rounds its gates and states to half step by step
#: (``Context.storage_dtype``), so its BPTT schedules recompute units exactly.
MIXED_PRECISION_KINDS = frozenset({"conv", "linear", "pool", "relu", "act", "bn", "flatten",
                                   "add", "concat", "loss", "dropout", "embedding", "norm",
                                   "attention", "rnn", "recurrent", "state", "stack"})

#: Layer kinds whose device path reads half operands directly (Linear and Conv2d: their GEMMs
#: through :func:`~minidl.kernels.device_gemm.gemm_ex`, a convolution's columns im2col'ed in
#: the half dtype (:mod:`~minidl.kernels.convolution.conv_device_half`), the bias added to the
#: float32 product, the bias gradient summed into float32): on a CUDA device they get their
#: half inputs, weight copies and output gradients as they are, and float32 arrays only for
#: what they write.
DEVICE_HALF_OPERAND_KINDS = frozenset({"linear", "conv"})
#: Layer kinds whose device kernels take every array in its program dtype: half feature maps
#: and gradients in and out (rounded once from float32 sums inside the kernel, or copied as
#: bits), float32 parameter gradients, within the workspace the plan declares for the half
#: dtype. No float32 copy and no temporary: such a step needs no scratch.
DEVICE_HALF_IO_KINDS = frozenset({"conv", "linear", "flatten", "relu", "pool", "loss"})
#: Layer kinds whose staged float32 copies a device makes one batch chunk at a time (each
#: sample's work is independent of the others': attention, the activations, adds), so that
#: they take a chunk's bytes; attention's dropout masks hash positions in the whole batch
#: (``Context.batch_offset``).
DEVICE_BATCH_CHUNKED_KINDS = frozenset({"attention", "act", "add"})
#: The most chunks such a step's batch is cut into.
MAX_BATCH_CHUNKS = 8


def batch_chunk(layer: Any, batch: int) -> int:
    """Samples per chunk of ``layer``'s staged step (``batch``: all at once)."""
    if layer.kind not in DEVICE_BATCH_CHUNKED_KINDS or batch <= 1:
        return batch
    return -(-batch // MAX_BATCH_CHUNKS)


def is_half(a: Any) -> bool:
    """Whether ``a`` is stored in a 2-byte float dtype (bfloat16 or float16)."""
    return a is not None and is_half_dtype(a.dtype)


def runs_mixed(step: Step, dtype_of: Sequence[np.dtype]) -> bool:
    """Whether ``step`` (a layer's forward, recompute or backward) touches a half tensor or
    keeps a cast copy: those go through :func:`forward` / :func:`backward`."""
    if step.node < 0:
        return False
    if step.cost.matmul_dtype in HALF_MATMULS:
        return True
    fw = step.forward
    tids = [*fw.inputs, *fw.outputs, *fw.stash.values(), *step.backward.grad_outputs,
            *(g.written for g in step.backward.grad_inputs if g is not None)]
    return any(is_half_dtype(dtype_of[t]) for t in tids)


def _up(a: Any, stage: Staging) -> Any:
    """``a`` as float32 (a staged copy) when it is half, else ``a`` itself."""
    return stage.copy(a, np.float32) if is_half(a) else a


def _scratch(a: Any, stage: Staging) -> Any:
    """An uninitialised float32 array (staged) for a half output ``a``, else ``a`` itself."""
    return stage.empty(a.shape, np.float32) if is_half(a) else a


def _round_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` rounded to ``dst``'s dtype (:func:`~..kernels.array_api.round_into`;
    nothing when they are one array)."""
    if dst is not src:
        round_into(dst, src)


def _split_stash(stash: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The layer's own stash entries and the cast copies (``name@dtype``)."""
    own = {k: v for k, v in stash.items() if CAST_MARK not in k}
    casts = {k.split(CAST_MARK)[0]: v for k, v in stash.items() if CAST_MARK in k}
    return own, casts


def _on_device(arrays: list) -> bool:
    """Whether the (non-``None``) arrays are C-contiguous device arrays."""
    return all(is_device_array(a) and a.flags.c_contiguous for a in arrays if a is not None)


def _reads_half(layer: Any, arrays: list) -> bool:
    """Whether ``layer`` takes its half operands as they are here: a
    :data:`DEVICE_HALF_OPERAND_KINDS` layer on C-contiguous device arrays."""
    return layer.kind in DEVICE_HALF_OPERAND_KINDS and _on_device(arrays)


def device_half_io(layer: Any) -> bool:
    """Whether ``layer``'s device kernels take every array in its program dtype
    (:data:`DEVICE_HALF_IO_KINDS`; a max pooling only when its windows do not overlap)."""
    if layer.kind not in DEVICE_HALF_IO_KINDS:
        return False
    if layer.kind == "pool":
        return isinstance(layer, MaxPool2d) and maxpool_half_exact(layer.kernel_size,
                                                                   layer.stride)
    if layer.kind == "loss":  # (its half logits made float32 a block of rows at a time)
        return isinstance(layer, SoftmaxCrossEntropy)
    return True


def _half_io(layer: Any, arrays: list) -> bool:
    """Whether ``layer`` runs on its arrays as they are (:func:`device_half_io`, on
    C-contiguous device arrays)."""
    return device_half_io(layer) and _on_device(arrays)


def _half_params(params: dict[str, Any], st: Step, stage: Staging,
                 keep_half: bool = False) -> dict[str, Any]:
    """The parameters as the layer computes with them: those the step rounds
    (``st.forward.param_casts``) rounded into a staged half copy, then as float32 (a staged
    copy), a half parameter (the device's only copy under ``offload=optimizer``) as float32,
    else the float32 parameter itself; ``keep_half``: the half copies and half parameters
    themselves."""
    casts = st.forward.param_casts
    out = {}
    for k, p in params.items():
        if k in casts:
            copy = stage.copy(p, casts[k])
            out[k] = copy if keep_half else stage.copy(copy, np.float32)
        else:
            out[k] = p if keep_half else _up(p, stage)
    return out


def _workspace(layer: Any, st: Step, ws: Any, in_shapes: list, backward: bool,
               stage: Staging) -> Any:
    """The layer's workspace for float32 compute: staged on a device (the lowering sized the
    step's workspace for it), on the host the arena's block when it is large enough, else a
    new host buffer."""
    options = st.op.options.as_layer_options
    size = (layer.backward_workspace_bytes if backward else layer.forward_workspace_bytes)(
        in_shapes, np.dtype(np.float32), **({"options": options} if layer.option_names else {}))
    if size <= 0:
        return ws
    if stage.buf is None and ws is not None and ws.nbytes >= size:
        return ws
    return stage.empty((size,), np.uint8)


def _cast_input(x: Any, j: int, casts: dict[str, Any], matmul_dtype: str, stage: Staging,
                keep_half: bool = False) -> Any:
    """Input ``j`` as a half op reads it: its kept cast copy (filled here), or rounded to the
    op's dtype for the step, then as float32 (``keep_half``: left in the half dtype)."""
    copy = casts.get(f"input{j}")
    if copy is not None:
        np.copyto(copy, x, casting="unsafe")
        return copy if keep_half else stage.copy(copy, np.float32)
    if matmul_dtype and is_float(x.dtype) and x.dtype.name != matmul_dtype:
        x = stage.copy(x, matmul_dtype)
        return x if keep_half else stage.copy(x, np.float32)
    return x if keep_half else _up(x, stage)


def _storing(ctx: Any, st: Step) -> Any:
    """``ctx`` telling a half matrix op the dtype its tensors are kept in
    (``Context.storage_dtype``: a recurrence rounds its states to it step by step)."""
    half = st.cost.matmul_dtype in HALF_MATMULS
    return replace(ctx, storage_dtype=np.dtype(st.cost.matmul_dtype)) if half else ctx


def _io_start(layer: Any, st: Step, in_shapes: list, backward: bool, arrays: list) -> int:
    """Bytes of a half-IO layer's own workspace (declared in the half dtype its kernels see:
    the step's product dtype, else its first half array's): its staged input casts and
    rounded parameters come after them."""
    options = st.op.options.as_layer_options
    half = np.dtype(st.cost.matmul_dtype) if st.cost.matmul_dtype else next(
        (a.dtype for a in arrays if is_half(a)), np.dtype(np.float16))
    return (layer.backward_workspace_bytes if backward else layer.forward_workspace_bytes)(
        in_shapes, half, **({"options": options} if layer.option_names else {}))


def forward(layer: Any, ctx: Any, st: Step, inputs: list, outputs: list,
            params: dict[str, Any], stash: dict[str, Any], workspace: Any) -> None:
    """Run a layer's forward (or recompute) step of a mixed-precision program."""
    own, casts = _split_stash(stash)
    ctx = _storing(ctx, st)
    shapes = [x.shape for x in inputs]
    if _half_io(layer, [*inputs, *outputs]):
        stage = Staging(workspace, inputs[0], _io_start(layer, st, shapes, False, inputs))
        ins = [_cast_input(x, j, casts, st.cost.matmul_dtype, stage, True)
               for j, x in enumerate(inputs)]
        layer.forward(ctx, ins, outputs, _half_params(params, st, stage, True), own,
                      workspace)
        return
    stage = Staging(workspace, inputs[0])
    half = _reads_half(layer, inputs)
    pars = _half_params(params, st, stage, half)
    for b0, _, cut in _chunks(layer, stage, _batch(inputs[0])):
        cuts = {k: cut(v) for k, v in casts.items()}
        ins = [_cast_input(cut(x), j, cuts, st.cost.matmul_dtype, stage, half)
               for j, x in enumerate(inputs)]
        outs = [_scratch(cut(y), stage) for y in outputs]
        own32 = {k: _up(cut(v), stage) for k, v in own.items()}
        ws = _workspace(layer, st, workspace, [x.shape for x in ins], False, stage)
        layer.forward(_at(ctx, b0), ins, outs, pars, own32, ws)
        for dst, src in zip(outputs, outs):
            _round_into(cut(dst), src)
        for k, v in own.items():
            _round_into(cut(v), own32[k])


def _batch(a: Any) -> int:
    """The batch size of a batch-first array (1 for a scalar)."""
    return a.shape[0] if a.ndim else 1


def _chunk_size(layer: Any, stage: Staging, batch: int) -> int:
    """Samples per chunk of a staged step: :func:`batch_chunk` on a device, else the batch."""
    return batch_chunk(layer, batch) if stage.buf is not None else batch


def _chunks(layer: Any, stage: Staging, batch: int):
    """``(first sample, samples, cut)`` per batch chunk of a staged step (:func:`batch_chunk`;
    one chunk, the arrays themselves, on the host or for other layers); each chunk's staged
    arrays reuse the workspace after the parameters'."""
    cb = _chunk_size(layer, stage, batch)
    if cb >= batch:
        yield 0, batch, lambda a: a
        return
    mark = stage.offset
    for b0 in range(0, batch, cb):
        stage.offset = mark
        yield b0, min(cb, batch - b0), lambda a, s=slice(b0, b0 + cb): None if a is None \
            else a[s]


def _at(ctx: Any, b0: int) -> Any:
    """``ctx`` for the batch chunk starting at sample ``b0`` (``Context.batch_offset``)."""
    return replace(ctx, batch_offset=b0) if b0 else ctx


def backward(layer: Any, ctx: Any, st: Step, grad_outputs: list, grad_inputs: list,
             inputs: list, outputs: list, params: dict[str, Any], grads: dict[str, Any],
             stash: dict[str, Any], workspace: Any, in_shapes: list) -> None:
    """Run a layer's backward step of a mixed-precision program: ``inputs`` holds ``None``
    where the layer keeps no input; an input its backward reads from a cast copy comes from
    the stash."""
    own, casts = _split_stash(stash)
    ctx = _storing(ctx, st)
    io = _half_io(layer, [*grad_outputs, *grad_inputs])
    stage = Staging(workspace, grad_outputs[0],
                    _io_start(layer, st, in_shapes, True, [*inputs, *grad_inputs])
                    if io else 0)
    half = io or _reads_half(layer, grad_outputs)
    keep = (lambda a: a) if half else (lambda a: _up(a, stage))
    read = []  # the inputs as the layer reads them: its cast copies, or the inputs
    for j, x in enumerate(inputs):
        copy = casts.get(f"input{j}")
        read.append(copy if copy is not None and j in layer.retain_inputs else x)
    if io:
        layer.backward(ctx, grad_outputs, grad_inputs, read, outputs,
                       _half_params(params, st, stage, True), grads, own, workspace)
        return
    pars = _half_params(params, st, stage, half)
    batch = _batch(grad_outputs[0])
    chunked = _chunk_size(layer, stage, batch) < batch
    # a chunked step writes each chunk's parameter gradients into staged partials and adds
    # them (no GEMM into a gradient with beta = 1, which would need a temporary)
    partials = {k: stage.empty(g.shape, g.dtype) for k, g in grads.items()} if chunked else {}
    sub = replace(ctx, accumulate=ctx.accumulate - frozenset(grads)) if chunked else ctx
    for b0, n, cut in _chunks(layer, stage, batch):
        ins = [None if x is None else keep(cut(x)) for x in read]
        g_in = [None if g is None else _scratch(cut(g), stage) for g in grad_inputs]
        shapes = in_shapes if n == batch else [(n, *tuple(s)[1:]) for s in in_shapes]
        ws = _workspace(layer, st, workspace, shapes, True, stage)
        own32 = {k: _up(cut(v), stage) for k, v in own.items()}
        layer.backward(_at(sub, b0), [keep(cut(g)) for g in grad_outputs], g_in, ins,
                       [None if y is None else keep(cut(y)) for y in outputs], pars,
                       partials or grads, own32, ws)
        for k, part in partials.items():
            if b0 == 0 and k not in ctx.accumulate:
                np.copyto(grads[k], part)
            else:
                np.add(grads[k], part, out=grads[k])
        for dst, src in zip(grad_inputs, g_in):
            if dst is not None:
                _round_into(cut(dst), src)
        for k, v in own.items():
            _round_into(cut(v), own32[k])


def backward_from_encoded(layer: Any, encoding: Any, encoded: Any, grad_output: Any,
                          grad_input: Any, workspace: Any = None) -> None:
    """A layer's backward from its encoded stash (Gist's sign mask, a max-pool's packed
    argmax) in a mixed-precision program: a half-IO layer's kernels on the half gradients
    themselves; otherwise on float32 copies (staged in ``workspace``), rounded once into the
    half input gradient, as :func:`backward` does."""
    if _half_io(layer, [grad_output, grad_input]):
        layer.backward_from_encoded(encoding, encoded, grad_output, grad_input)
        return
    stage = Staging(workspace, grad_output)
    g_in = _scratch(grad_input, stage)
    layer.backward_from_encoded(encoding, encoded, _up(grad_output, stage), g_in)
    _round_into(grad_input, g_in)
