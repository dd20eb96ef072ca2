"""The layer contract: pure math with declared needs.

A layer never allocates device memory and never decides where bytes live. It declares, from
the shapes of its inputs, everything the engine needs to plan memory before any compute
(Caffe's SetUp/Reshape): its output shapes and dtypes, its parameters, what its backward keeps
(Chainer's retain_inputs / retain_outputs plus a small named *stash*), its workspace bytes and
its cost. The engine hands it arrays (views into the device pool) to read and write.

Conventions of ``forward`` / ``backward`` (llm.c's paired functions):

* ``forward(ctx, inputs, outputs, params, stash, workspace)`` writes every output in place.
* ``backward(ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params, stash,
  workspace)`` *overwrites* every non-``None`` entry of ``grad_inputs`` and every array of
  ``grad_params``; the engine accumulates at fan-out and for shared parameters. A layer with
  ``accumulates_grads`` instead *adds* into the ``grad_params`` named in ``ctx.accumulate``
  (micro-batches, a shared parameter's second use), so no partial gradient buffer is needed.
  ``inputs`` / ``outputs`` hold arrays only at the indices listed in ``retain_inputs`` /
  ``retain_outputs`` (``None`` elsewhere). ``grad_inputs[i]`` is ``None`` when that gradient is
  not needed (network inputs, labels, integer tensors).
* ``params`` maps parameter names to arrays (trainable ones and buffers such as BatchNorm's
  running statistics); ``grad_params`` maps trainable names to gradient arrays.
* ``stash`` maps the names of :meth:`Layer.stash_specs` to arrays, written by forward and
  read by backward (e.g. MaxPool's argmax, BatchNorm's batch mean and inverse std).
* ``workspace`` is a 1-D ``uint8`` array of at least the declared bytes (or ``None`` if zero);
  view it as needed. Its contents do not survive between calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels.vocabulary import DeviceKind, RecomputeCost, StashEncoding

Shape = tuple[int, ...]


def device_kind(options: dict | None) -> DeviceKind:
    """The kind of device a layer's per-op ``options`` name (``"device_kind"``; CPU without
    one); a ``ValueError`` naming the valid kinds for an unknown one."""
    return DeviceKind.of((options or {}).get("device_kind", DeviceKind.CPU))


class ShapeError(ValueError):
    """An input shape a layer cannot accept; the message names the layer and both shapes."""


@dataclass(frozen=True)
class ParamSpec:
    """A parameter or buffer: its shape, how to initialise it, and whether it is trained.

    ``init`` is one of ``"zeros"``, ``"ones"``, ``"uniform"`` (U(-bound, bound) with
    ``bound = gain / sqrt(fan_in)``, PyTorch's default for Linear and Conv), ``"normal"``
    (N(0, gain)) . ``dtype`` fixes the array's dtype (BatchNorm's int64 ``num_batches_tracked``);
    ``None`` takes the network's float dtype.
    """

    shape: Shape
    init: str = "uniform"
    fan_in: int = 1
    gain: float = 1.0
    trainable: bool = True
    dtype: str | None = None

    def initial_value(self, rng: np.random.Generator, dtype: Any = np.float32) -> np.ndarray:
        if self.dtype is not None:
            dtype = np.dtype(self.dtype)
        if self.init == "zeros":
            return np.zeros(self.shape, dtype=dtype)
        if self.init == "ones":
            return np.ones(self.shape, dtype=dtype)
        if self.init == "uniform":
            bound = self.gain / math.sqrt(max(self.fan_in, 1))
            return rng.uniform(-bound, bound, size=self.shape).astype(dtype)
        if self.init == "normal":
            return (rng.standard_normal(self.shape) * self.gain).astype(dtype)
        raise ValueError(f"unknown initialiser {self.init!r}")


@dataclass
class Context:
    """Per-call facts a layer may need: mode, a reproducible seed, and whether this is a replay.

    ``seed`` is fixed per (layer, iteration): a recomputed forward gets the same seed, so a
    dropout mask is replayed exactly. ``recomputing`` is true when the engine re-runs a forward
    to rebuild a dropped feature map; layers must then leave their buffers (BatchNorm's running
    statistics) untouched.
    """

    training: bool = True
    seed: int = 0
    recomputing: bool = False
    #: Names of ``grad_params`` that backward adds into rather than overwrites (layers with
    #: ``accumulates_grads`` only).
    accumulate: frozenset[str] = frozenset()
    #: Per-op options the plan set on this step (see :attr:`Layer.option_names`).
    options: dict[str, Any] = field(default_factory=dict)
    #: Data-parallel training with synchronised batch statistics, else ``None``: an object
    #: with ``share`` (this rank's fraction of the global batch) and ``sum(array)`` (sums a
    #: float64 array over the ranks, in place). BatchNorm then normalises with the global
    #: batch's statistics.
    batch_sync: Any = None
    #: Under mixed precision, the half dtype the step's tensors are kept in while the layer
    #: computes on float32 copies of them, else ``None``: a layer that carries state from one
    #: time step to the next rounds it to this dtype as it writes it (so that a recomputation
    #: from kept states reproduces the forward exactly).
    storage_dtype: Any = None
    #: The index of the first sample this call sees when a step runs one batch chunk at a
    #: time (a device's mixed-precision staging): dropout masks hash positions in the whole
    #: batch, so a layer drawing them offsets its positions by it.
    batch_offset: int = 0


class Symbol:
    """A symbolic tensor of the functional graph builder: the ``index``-th output of ``layer``
    applied to ``inputs`` (or a network input when ``layer`` is ``None``)."""

    __slots__ = ("layer", "inputs", "index", "shape", "dtype", "name")

    def __init__(
        self,
        layer: Layer | None,
        inputs: tuple[Symbol, ...],
        index: int = 0,
        shape: Shape | None = None,
        dtype: Any = None,
        name: str | None = None,
    ) -> None:
        self.layer = layer
        self.inputs = inputs
        self.index = index
        self.shape = shape
        self.dtype = dtype
        self.name = name

    def __repr__(self) -> str:
        owner = self.name if self.layer is None else type(self.layer).__name__
        return f"Symbol({owner}[{self.index}], shape={self.shape})"


class Layer:
    """Base class of every layer. Subclasses override the declarations and the two kernels."""

    #: Op tag shown in reports (conv, linear, relu, act, pool, bn, ...); memory never reads it.
    kind: str = "generic"
    # ---- memory capabilities, in the vocabulary of minidl.kernels.vocabulary (lowering checks
    # them and refuses unknown ones)
    #: CHEAP (recomputed freely), EXPENSIVE (kept as a checkpoint: conv, linear, joins) or
    #: SEQUENCE (a whole sequence in one op: never recomputed as a whole).
    recompute_cost: RecomputeCost = RecomputeCost.CHEAP
    #: Encodings backward can start from instead of the dense stash (SIGN: ReLU's output
    #: sign; PACKED_ARGMAX: a max-pool's argmax packed), through
    #: :meth:`backward_from_encoded`.
    backward_from: tuple[StashEncoding, ...] = ()
    #: Outputs mostly zeros (ReLU); a convolution (vDNN swaps its inputs, Gist keeps them sparse).
    sparse_output: bool = False
    convolution: bool = False
    #: Per-op options a memory pass may set on this op's steps ("bptt": a fused RNN's BPTT
    #: schedule). A layer naming any takes ``options=`` in :meth:`stash_specs` and the
    #: workspace-size methods, and reads ``ctx.options`` in forward and backward.
    option_names: tuple[str, ...] = ()
    #: Number of inputs, or ``None`` for a variable number (Add, Concat).
    num_inputs: int | None = 1
    num_outputs: int = 1
    #: Indices of inputs / outputs that backward reads.
    retain_inputs: tuple[int, ...] = ()
    retain_outputs: tuple[int, ...] = ()
    #: Forward may write output 0 over input 0 (same memory).
    inplace_forward: bool = False
    #: Backward may write grad_inputs[0] over grad_outputs[0] (same memory).
    inplace_backward: bool = False
    #: Inputs that are integer indices or labels (no gradient ever flows to them).
    nondiff_inputs: tuple[int, ...] = ()
    #: Backward adds into the ``grad_params`` named in ``ctx.accumulate`` (see module docstring).
    accumulates_grads: bool = False
    #: The user's memory choice for this node's feature maps (``"recompute"``, ``"swap"``,
    #: ``"keep"``; ``""``: the planner decides), set by ``layer(x, memory=...)`` or a
    #: :class:`~minidl.layers.checkpoint.Checkpoint` block. A mark of the graph, not of the
    #: math: lowering puts it on the node's steps and the network checks the value.
    memory_choice: str = ""

    def __init__(self) -> None:
        self.name: str | None = None

    # ----------------------------------------------------------------- graph building
    def __call__(self, *inputs: Symbol, memory: str | None = None
                 ) -> Symbol | tuple[Symbol, ...]:
        """Apply the layer to symbolic tensors. ``memory`` forces the planners' choice for its
        feature maps: ``"recompute"`` (dropped in forward, recomputed in backward),
        ``"swap"`` (offloaded to host and prefetched) or ``"keep"``."""
        for s in inputs:
            if not isinstance(s, Symbol):
                raise TypeError(
                    f"{type(self).__name__} takes symbolic tensors (from minidl.Input or another "
                    f"layer), got {type(s).__name__}"
                )
        if self.num_inputs is not None and len(inputs) != self.num_inputs:
            raise TypeError(
                f"{type(self).__name__} takes {self.num_inputs} input(s), got {len(inputs)}"
            )
        if memory is not None:
            self.memory_choice = memory
        outs = tuple(Symbol(self, tuple(inputs), i) for i in range(self.num_outputs))
        return outs[0] if self.num_outputs == 1 else outs

    # ----------------------------------------------------------------- declarations
    def output_shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        """Full shapes (batch first) of the outputs; raise :class:`ShapeError` if invalid."""
        return [tuple(in_shapes[0])]

    def output_dtypes(self, in_dtypes: list[np.dtype]) -> list[np.dtype]:
        return [np.dtype(in_dtypes[0])] * self.num_outputs

    def param_specs(self) -> dict[str, ParamSpec]:
        """Parameters and buffers by PyTorch name (``weight``, ``bias``, ``running_mean``...)."""
        return {}

    def stash_specs(self, in_shapes: list[Shape], dtype: np.dtype) -> dict[str, tuple[Shape, Any]]:
        """Extra arrays forward saves for backward: name -> (shape, dtype)."""
        return {}

    def forward_workspace_bytes(self, in_shapes: list[Shape], dtype: np.dtype) -> int:
        return 0

    def backward_workspace_bytes(self, in_shapes: list[Shape], dtype: np.dtype) -> int:
        return 0

    def flops(self, in_shapes: list[Shape]) -> int:
        """Forward floating-point operations (backward is costed at twice this by default)."""
        return int(sum(math.prod(s) for s in self.output_shapes(in_shapes)))

    def recompute_flops(self, in_shapes: list[Shape], options: dict | None = None) -> int:
        """Forward FLOPs the layer's backward runs again under ``options`` (a BPTT schedule
        that keeps fewer states): counted in its backward step's cost. None by default."""
        return 0

    def memory_attrs(self, in_shapes: list[Shape]) -> dict:
        """Plain facts memory passes need about the op on inputs of ``in_shapes`` (a max-pool's
        window, for packing its argmax; a convolution's geometry; a fused RNN's time units);
        never arrays or objects."""
        return {}

    # ----------------------------------------------------------------- compute
    def check_feed(self, index: int, host: np.ndarray, in_shapes: list[Shape]) -> None:
        """Check ``host``, a host array about to be sent to a device as this layer's input
        ``index`` (``in_shapes``: the step's input shapes), raising as :meth:`forward` would on
        host arrays. Value checks of device arrays (class labels in range, ...) would make the
        host wait for the device, so layers make them on host arrays only and here before the
        upload. Default: nothing to check."""

    def forward(self, ctx: Context, inputs, outputs, params, stash, workspace) -> None:
        raise NotImplementedError

    def backward(
        self, ctx: Context, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
        stash, workspace,
    ) -> None:
        raise NotImplementedError

    def backward_from_encoded(self, encoding: str, encoded, grad_output, grad_input) -> None:
        """Backward (input gradient only) straight from ``encoded``, this op's stash in one of
        the encodings of :attr:`backward_from`. Layers declaring an encoding override it."""
        raise NotImplementedError(f"{type(self).__name__} has no backward from {encoding!r}")

    # ----------------------------------------------------------------- helpers
    def describe(self) -> str:
        return type(self).__name__

    def shape_error(self, expected: str, got: Shape) -> ShapeError:
        who = self.name or type(self).__name__
        return ShapeError(f"layer {who} ({self.describe()}) expects input {expected}, got {got}")

    def __repr__(self) -> str:
        return self.describe()
