"""Conv2d: 2-D convolution over NCHW activations with PyTorch's weight layout and init."""

from __future__ import annotations

import numpy as np

from ...kernels.convolution.conv import (
    conv2d_backward,
    conv2d_device_half_workspace_bytes,
    conv2d_device_workspace_bytes,
    conv2d_forward,
    conv2d_workspace_bytes,
    conv_output_hw,
    is_half_dtype,
)
from ...kernels.vocabulary import DeviceKind, RecomputeCost
from ..base import Layer, ParamSpec, Shape, device_kind


def _pair(v: int | tuple[int, int], name: str, minimum: int) -> tuple[int, int]:
    p = (v, v) if isinstance(v, (int, np.integer)) else tuple(v)
    if len(p) != 2 or not all(isinstance(a, (int, np.integer)) for a in p):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    if min(p) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v!r}")
    return int(p[0]), int(p[1])


def workspace_cap(options: dict | None, backward: bool) -> int | None:
    """The ``"conv_ws"`` option's cap (bytes) for the forward or backward step: one int >= 0
    for both, or a ``(forward, backward)`` pair of them; ``None``: no cap."""
    cap = (options or {}).get("conv_ws")
    if isinstance(cap, (tuple, list)) and len(cap) == 2:
        cap = cap[int(bool(backward))]
    if cap is None:
        return None
    if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 0:
        raise ValueError(f"Conv2d: the conv_ws option is a workspace cap in bytes (an int "
                         f">= 0, None, or a (forward, backward) pair of them), got {cap!r}")
    return int(cap)


class Conv2d(Layer):
    """``y = conv2d(x, weight) + bias`` like ``torch.nn.Conv2d`` (zero padding, NCHW).

    ``weight`` is ``(out_channels, in_channels // groups, kh, kw)``, ``bias`` ``(out_channels,)``,
    both initialised U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as in PyTorch. Backward keeps only
    the input; the im2col buffers live in the declared workspace, whose size depends on the
    ``"device_kind"`` option (``"cpu"``: the Numba kernels'; ``"cuda"``: the device path's,
    :func:`~minidl.kernels.convolution.conv_device.conv2d_device_workspace_bytes`) and on the
    ``"conv_ws"`` option: a cap in bytes on each step's workspace, or a ``(forward,
    backward)`` pair of caps (absent or ``None``: the fastest configuration). Under a cap the
    kernels run the fastest algorithm and chunking that fit it
    (:func:`~minidl.kernels.convolution.conv_geometry.conv_config`: im2col instead of Winograd,
    fewer
    images per product and smaller bands, one gradient part, fewer threads' rows): the whole
    batch still goes in and out, computed a sub-batch of images (or a band of one image) at a
    time. Results then agree with the default's to float32 rounding (sums in another order),
    and stay bit-identical across thread counts for a given cap.
    """

    kind = "conv"
    recompute_cost = RecomputeCost.EXPENSIVE
    convolution = True
    retain_inputs = (0,)
    accumulates_grads = True
    option_names = ("device_kind", "conv_ws")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if in_channels < 1 or out_channels < 1 or groups < 1:
            raise ValueError("in_channels, out_channels and groups must be positive")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"in_channels ({in_channels}) and out_channels ({out_channels}) must be "
                f"divisible by groups ({groups})"
            )
        self.in_channels = int(in_channels)
        self.out_channels = int(out_channels)
        self.kernel_size = _pair(kernel_size, "kernel_size", 1)
        self.stride = _pair(stride, "stride", 1)
        self.padding = _pair(padding, "padding", 0)
        self.dilation = _pair(dilation, "dilation", 1)
        self.groups = int(groups)
        self.bias = bool(bias)

    def describe(self) -> str:
        s = (f"Conv2d({self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}")
        if self.padding != (0, 0):
            s += f", padding={self.padding}"
        if self.dilation != (1, 1):
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if not self.bias:
            s += ", bias=False"
        return s + ")"

    # ----------------------------------------------------------------- declarations
    def _fan_in(self) -> int:
        return self.in_channels // self.groups * self.kernel_size[0] * self.kernel_size[1]

    def output_shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        s = tuple(in_shapes[0])
        expected = f"(N, {self.in_channels}, H, W)"
        if len(s) != 4 or s[1] != self.in_channels:
            raise self.shape_error(expected, s)
        ho, wo = conv_output_hw(s[2:], self.kernel_size, self.stride, self.padding, self.dilation)
        if ho < 1 or wo < 1:
            raise self.shape_error(
                f"{expected} with H, W large enough for a positive output (got output "
                f"{ho}x{wo})", s)
        return [(s[0], self.out_channels, ho, wo)]

    def param_specs(self) -> dict[str, ParamSpec]:
        kh, kw = self.kernel_size
        fan_in = self._fan_in()
        specs = {"weight": ParamSpec(
            (self.out_channels, self.in_channels // self.groups, kh, kw), "uniform", fan_in)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_channels,), "uniform", fan_in)
        return specs

    def stash_specs(self, in_shapes: list[Shape], dtype: np.dtype,
                    options: dict | None = None) -> dict[str, tuple]:
        return {}

    def memory_attrs(self, in_shapes: list[Shape]) -> dict:
        """The geometry memory estimates the times of workspace caps from."""
        return {"convolution": {
            "out_channels": self.out_channels, "kernel": tuple(self.kernel_size),
            "stride": tuple(self.stride), "padding": tuple(self.padding),
            "dilation": tuple(self.dilation), "groups": self.groups}}

    def _workspace(self, in_shapes: list[Shape], dtype: np.dtype, backward: bool,
                   options: dict | None) -> int:
        self.output_shapes(in_shapes)
        options = options or {}
        kind = device_kind(options)
        cap = workspace_cap(options, backward)
        geom = (tuple(in_shapes[0]), self.out_channels, self.kernel_size, self.stride,
                self.padding, self.dilation, self.groups, dtype, backward)
        if kind == DeviceKind.CUDA:
            if is_half_dtype(dtype):  # (mixed precision: half operands, half outputs)
                return conv2d_device_half_workspace_bytes(*geom[:7], backward,
                                                          max_workspace=cap)
            return conv2d_device_workspace_bytes(*geom, max_workspace=cap)
        return conv2d_workspace_bytes(*geom, max_workspace=cap)

    def forward_workspace_bytes(self, in_shapes: list[Shape], dtype: np.dtype,
                                options: dict | None = None) -> int:
        return self._workspace(in_shapes, dtype, False, options)

    def backward_workspace_bytes(self, in_shapes: list[Shape], dtype: np.dtype,
                                 options: dict | None = None) -> int:
        return self._workspace(in_shapes, dtype, True, options)

    def flops(self, in_shapes: list[Shape]) -> int:
        n, cout, ho, wo = self.output_shapes(in_shapes)[0]
        return 2 * n * cout * ho * wo * self._fan_in()

    # ----------------------------------------------------------------- compute
    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        conv2d_forward(
            inputs[0], params["weight"], params.get("bias"), outputs[0], self.stride,
            self.padding, self.dilation, self.groups, workspace,
            max_workspace=workspace_cap(ctx.options, False))

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        # micro-batches: add into .grad, no partial (a shared bias may differ from its weight)
        conv2d_backward(
            inputs[0], params["weight"], grad_outputs[0], grad_inputs[0],
            grad_params["weight"], grad_params.get("bias"), self.stride, self.padding,
            self.dilation, self.groups, workspace, accumulate="weight" in ctx.accumulate,
            accumulate_bias="bias" in ctx.accumulate,
            max_workspace=workspace_cap(ctx.options, True))


__all__ = ["Conv2d"]
