"""BatchNorm1d / BatchNorm2d with PyTorch's parameters, buffers and running-statistics rules."""

from __future__ import annotations

import math

import numpy as np

from ...kernels import _cuda
from ...kernels.array_api import namespace
from ...kernels.normalization import batchnorm as bnk
from ...kernels.vocabulary import DeviceKind
from ..base import Layer, ParamSpec, device_kind


class _BatchNorm(Layer):
    """Normalises each channel (axis 1) over the batch and all trailing axes.

    Training (or ``track_running_stats=False``): batch mean and biased variance normalise;
    running stats are updated as PyTorch (``(1 - momentum) * running + momentum * batch``,
    unbiased variance) unless ``ctx.recomputing``. Eval: the running statistics.

    With ``track_running_stats`` the buffers are PyTorch's: ``running_mean``, ``running_var``
    and the int64 counter ``num_batches_tracked``, incremented by each training forward (so that
    state dicts move between the two with ``strict=True``). ``momentum=None`` makes the running
    statistics a cumulative average: the update weight is ``1 / num_batches_tracked``.

    With ``ctx.batch_sync`` (data-parallel ``sync_bn``) the batch statistics are the global
    batch's: the mean from summed per-rank sums, the variance from summed squared deviations
    from it (two collectives, no E[x^2] - E[x]^2 cancellation), and backward's two reductions
    summed over the ranks (in the global loss's units, then back in this rank's).

    Stash: ``mean`` and ``invstd`` (C,) in the compute dtype, of whichever statistics forward
    used. Backward retains only the input and rebuilds x_hat from it. ``inplace_forward`` is
    False because training needs the input; in eval mode in-place would be valid (the flag is
    static). ``inplace_backward`` is True: the gradient kernel reads dy before writing dx.

    On a device, forward and backward are Numba CUDA kernels
    (:mod:`minidl.kernels.normalization.batchnorm`),
    the per-channel bookkeeping included (the running statistics, ``momentum=None``'s counter):
    nothing is read on the host and no array is made beyond the workspace's per-channel
    vectors (sync-BN's collectives keep their array operations).
    """

    kind = "bn"
    retain_inputs = (0,)
    accumulates_grads = True
    inplace_backward = True
    #: On a GPU (``device_kind="cuda"``) the workspaces hold the kernels' per-channel vectors:
    #: float64 statistics or sums, and scale / shift (forward) or the coefficients of dx
    #: (backward) in the compute dtype; nothing for ``"cpu"``.
    option_names = ("device_kind",)
    _ranks: tuple[int, ...] = ()
    _layout = ""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be positive, got {num_features}")
        if momentum is not None and not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be a number in [0, 1] or None, got {momentum}")
        self.num_features = int(num_features)
        self.eps = float(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.affine = bool(affine)
        self.track_running_stats = bool(track_running_stats)

    # ----------------------------------------------------------------- declarations
    def output_shapes(self, in_shapes):
        (s,) = in_shapes
        s = tuple(s)
        if len(s) not in self._ranks or s[1] != self.num_features:
            raise self.shape_error(self._layout.format(C=self.num_features), s)
        return [s]

    def param_specs(self):
        c = (self.num_features,)
        specs = {}
        if self.affine:
            specs["weight"] = ParamSpec(c, "ones")
            specs["bias"] = ParamSpec(c, "zeros")
        if self.track_running_stats:
            specs["running_mean"] = ParamSpec(c, "zeros", trainable=False)
            specs["running_var"] = ParamSpec(c, "ones", trainable=False)
            specs["num_batches_tracked"] = ParamSpec((), "zeros", trainable=False, dtype="int64")
        return specs

    def stash_specs(self, in_shapes, dtype, options=None):
        c = (self.num_features,)
        return {"mean": (c, np.dtype(dtype)), "invstd": (c, np.dtype(dtype))}

    #: Per-channel vectors of a device forward / backward: (float64, compute dtype).
    _DEVICE_VECTORS = {"forward": (2, 2), "backward": (2, 3)}

    def _device_bytes(self, phase: str, dtype) -> int:
        n64, ndt = self._DEVICE_VECTORS[phase]
        return self.num_features * (8 * n64 + np.dtype(dtype).itemsize * ndt)

    def forward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        if device_kind(options) != DeviceKind.CUDA:
            return 0
        return self._device_bytes("forward", dtype)

    def backward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        if device_kind(options) != DeviceKind.CUDA:
            return 0
        return self._device_bytes("backward", dtype)

    def flops(self, in_shapes):
        return 4 * math.prod(in_shapes[0])  # stats (2 passes) + normalise and scale-shift

    # ----------------------------------------------------------------- compute
    @staticmethod
    def _view3(a: np.ndarray) -> np.ndarray:
        """(N, C, ...) as (N, C, S); a view for contiguous arrays (the pool's are)."""
        v = a.reshape(a.shape[0], a.shape[1], -1)
        if not np.may_share_memory(v, a) and a.size:
            raise ValueError("BatchNorm needs C-contiguous arrays")
        return v

    def _batch_stats(self, ctx) -> bool:
        return ctx.training or not self.track_running_stats

    def _scale_shift(self, params, invstd, dtype):
        if self.affine:
            return params["weight"] * invstd, params["bias"]
        return invstd, namespace(invstd).zeros(self.num_features, dtype)

    def _check_count(self, ctx, count: int, shape) -> None:
        if ctx.training and count < 2:
            raise ValueError(
                f"layer {self.name or type(self).__name__} ({self.describe()}): expected "
                f"more than 1 value per channel when training, got input {shape}"
            )

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x = self._view3(inputs[0])
        y = self._view3(outputs[0])
        if _cuda.is_device_array(x):
            self._forward_device(ctx, x, y, inputs[0].shape, params, stash, workspace)
            return
        dt = x.dtype
        xp = namespace(x)  # float64 statistics on x's device
        mean, invstd = stash["mean"], stash["invstd"]
        if self._batch_stats(ctx):
            count = x.shape[0] * x.shape[2]
            self._check_count(ctx, count, inputs[0].shape)
            m64 = xp.empty(self.num_features)
            v64 = xp.empty(self.num_features)
            bnk.stats(x, m64, v64)
            if ctx.batch_sync is not None:
                m64, v64, count = self._global_stats(ctx.batch_sync, m64, v64, count, xp)
            mean[...] = m64
            invstd[...] = 1.0 / xp.sqrt(v64 + self.eps)
            if ctx.training and self.track_running_stats and not ctx.recomputing:
                tracked = params["num_batches_tracked"]
                tracked += 1
                mom = 1.0 / float(tracked) if self.momentum is None else self.momentum
                rm, rv = params["running_mean"], params["running_var"]
                rm[...] = (1.0 - mom) * rm + mom * m64
                rv[...] = (1.0 - mom) * rv + mom * v64 * (count / (count - 1))
        else:
            mean[...] = params["running_mean"]
            invstd[...] = 1.0 / xp.sqrt(params["running_var"].astype(np.float64) + self.eps)
        scale, shift = self._scale_shift(params, invstd, dt)
        bnk.apply(x, mean, scale.astype(dt, copy=False), shift.astype(dt, copy=False), y)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        x = self._view3(inputs[0])
        dy = self._view3(grad_outputs[0])
        if _cuda.is_device_array(x):
            dx = None if grad_inputs[0] is None else self._view3(grad_inputs[0])
            self._backward_device(ctx, x, dy, dx, params, grad_params, stash, workspace)
            return
        dt = x.dtype
        mean, invstd = stash["mean"], stash["invstd"]
        c = self.num_features
        xp = namespace(x)
        sum_dy = xp.empty(c)
        sum_dy_xmu = xp.empty(c)
        bnk.reduce(dy, x, mean, sum_dy, sum_dy_xmu)
        inv64 = invstd.astype(np.float64)
        dgamma = sum_dy_xmu * inv64
        if self.affine:
            for key, grad in (("weight", dgamma), ("bias", sum_dy)):
                if key in grad_params:
                    if key in ctx.accumulate:
                        grad_params[key][...] += grad
                    else:
                        grad_params[key][...] = grad
        if grad_inputs[0] is None:
            return
        dx = self._view3(grad_inputs[0])
        gamma = params["weight"].astype(np.float64) if self.affine else 1.0
        k = gamma * inv64
        if self._batch_stats(ctx) and ctx.batch_sync is not None:
            # d(global loss)/dx: the sums over every rank's rows, in the global loss's units
            # (this rank's loss counts ``share`` of it), then back in this rank's units
            sync = ctx.batch_sync
            both = xp.concatenate([sum_dy * sync.share, sum_dy_xmu * sync.share,
                                   xp.asarray([float(x.shape[0] * x.shape[2])])])
            sync.sum(both)
            scale = 1.0 / (sync.share * float(both[-1]))
            shift = both[:c] * scale
            coef = inv64 * (both[c:2 * c] * inv64) * scale
        elif self._batch_stats(ctx):
            count = x.shape[0] * x.shape[2]
            shift = sum_dy / count
            coef = inv64 * dgamma / count
        else:  # running statistics are constants: dx = gamma * invstd * dy
            shift = xp.zeros(c)
            coef = xp.zeros(c)
        bnk.backward_apply(dy, x, mean, k.astype(dt), shift.astype(dt), coef.astype(dt), dx)

    # ----------------------------------------------------------------- device
    def _device_vectors(self, phase: str, workspace, x) -> list:
        """The per-channel vectors of a device ``phase`` (``_DEVICE_VECTORS``: float64 ones,
        then compute-dtype ones) in the workspace (made when it is missing or too small)."""
        c, nbytes = self.num_features, self._device_bytes(phase, x.dtype)
        if workspace is None or workspace.nbytes < nbytes:
            workspace = _cuda.empty(x, nbytes, np.uint8)
        ws = _cuda.flat(workspace, "workspace")[:nbytes]
        n64, ndt = self._DEVICE_VECTORS[phase]
        f64, fdt = ws[:8 * n64 * c].view(np.float64), ws[8 * n64 * c:].view(x.dtype)
        return [f64[i * c:(i + 1) * c] for i in range(n64)] + \
            [fdt[i * c:(i + 1) * c] for i in range(ndt)]

    def _forward_device(self, ctx, x, y, shape, params, stash, workspace) -> None:
        """Forward on device arrays: the statistics, their bookkeeping and the apply, three
        kernels (two with the running statistics); no host read, no array made."""
        mean64, var64, scale, shift = self._device_vectors("forward", workspace, x)
        update, unbias = False, 1.0
        if self._batch_stats(ctx):
            count = x.shape[0] * x.shape[2]
            self._check_count(ctx, count, shape)
            bnk.stats(x, mean64, var64)
            if ctx.batch_sync is not None:
                mean64, var64, count = self._global_stats(ctx.batch_sync, mean64, var64, count,
                                                          namespace(x))
            update = ctx.training and self.track_running_stats and not ctx.recomputing
            unbias = count / (count - 1) if update else 1.0
        else:
            mean64, var64 = params["running_mean"], params["running_var"]
        running = ("running_mean", "running_var", "num_batches_tracked")
        rm, rv, tracked = (params[k] if self.track_running_stats else None for k in running)
        bnk.finalize_device(mean64, var64, self.eps, stash["mean"], stash["invstd"], scale,
                            shift, weight=params["weight"] if self.affine else None,
                            bias=params["bias"] if self.affine else None, running_mean=rm,
                            running_var=rv, tracked=tracked, momentum=self.momentum,
                            unbias=unbias, update=update)
        bnk.apply(x, stash["mean"], scale, shift, y)

    def _backward_device(self, ctx, x, dy, dx, params, grad_params, stash, workspace) -> None:
        """Backward on device arrays: the sums, the gradients and dx's coefficients, and dx,
        three kernels; no host read (but sync-BN's), no array made (but sync-BN's)."""
        sum_dy, sum_dy_xmu, k, shift, coef = self._device_vectors("backward", workspace, x)
        mean, invstd = stash["mean"], stash["invstd"]
        bnk.reduce(dy, x, mean, sum_dy, sum_dy_xmu)
        batch = self._batch_stats(ctx)
        norm_dy, norm_dy_xmu, count = sum_dy, sum_dy_xmu, float(x.shape[0] * x.shape[2])
        if batch and ctx.batch_sync is not None and dx is not None:
            # d(global loss)/dx: the sums over every rank's rows, in the global loss's units
            # (this rank's loss counts ``share`` of it), then back in this rank's units
            sync, c, xp = ctx.batch_sync, self.num_features, namespace(x)
            both = xp.concatenate([sum_dy * sync.share, sum_dy_xmu * sync.share,
                                   xp.asarray([count])])
            sync.sum(both)
            norm_dy, norm_dy_xmu = both[:c], both[c:2 * c]
            count = sync.share * float(both[-1])
        grads = {key: grad_params[key] for key in ("weight", "bias")
                 if self.affine and key in grad_params}
        bnk.backward_finalize_device(
            sum_dy, sum_dy_xmu, invstd, k, shift, coef,
            weight=params["weight"] if self.affine else None, grad_weight=grads.get("weight"),
            grad_bias=grads.get("bias"), accumulate=tuple(ctx.accumulate), norm_dy=norm_dy,
            norm_dy_xmu=norm_dy_xmu, count=count, batch_stats=batch)
        if dx is not None:
            bnk.backward_apply(dy, x, mean, k, shift, coef, dx)

    def _global_stats(self, sync, m64, v64, count: int, xp):
        """The global batch's mean and biased variance from this rank's, and its count."""
        sums = xp.concatenate([m64 * count, xp.asarray([float(count)])])
        sync.sum(sums)
        total = float(sums[-1])
        mean = sums[:-1] / total
        dev = count * (v64 + (m64 - mean) ** 2)  # this rank's squared deviations from it
        sync.sum(dev)
        return mean, dev / total, int(total)

    def describe(self) -> str:
        extra = ""
        if self.eps != 1e-5:
            extra += f", eps={self.eps:g}"
        if self.momentum is None:
            extra += ", momentum=None"
        elif self.momentum != 0.1:
            extra += f", momentum={self.momentum:g}"
        if not self.affine:
            extra += ", affine=False"
        if not self.track_running_stats:
            extra += ", track_running_stats=False"
        return f"{type(self).__name__}({self.num_features}{extra})"


class BatchNorm1d(_BatchNorm):
    """Batch normalisation over (N, C) or (N, C, L) inputs."""

    _ranks = (2, 3)
    _layout = "(N, {C}) or (N, {C}, L)"


class BatchNorm2d(_BatchNorm):
    """Batch normalisation over (N, C, H, W) inputs."""

    _ranks = (4,)
    _layout = "(N, {C}, H, W)"
