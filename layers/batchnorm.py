"""BatchNorm1d / BatchNorm2d with PyTorch's parameters, buffers and running-statistics rules."""

from __future__ import annotations

import math

import numpy as np

from ..kernels import batchnorm as bnk
from ..kernels.array_api import namespace
from .base import Layer, ParamSpec


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
    """

    kind = "bn"
    retain_inputs = (0,)
    accumulates_grads = True
    inplace_backward = True
    #: On a GPU, backward needs one array of the input's size as scratch (the forward uses its
    #: output): the workspace is that array for ``device_kind="cuda"``, nothing for ``"cpu"``.
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

    def forward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        return 0

    def backward_workspace_bytes(self, in_shapes, dtype, options=None) -> int:
        if (options or {}).get("device_kind", "cpu") != "cuda":
            return 0
        return math.prod(in_shapes[0]) * np.dtype(dtype).itemsize

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

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        x = self._view3(inputs[0])
        y = self._view3(outputs[0])
        dt = x.dtype
        xp = namespace(x)  # float64 statistics on x's device
        mean, invstd = stash["mean"], stash["invstd"]
        if self._batch_stats(ctx):
            count = x.shape[0] * x.shape[2]
            if ctx.training and count < 2:
                raise ValueError(
                    f"layer {self.name or type(self).__name__} ({self.describe()}): expected "
                    f"more than 1 value per channel when training, got input {inputs[0].shape}"
                )
            m64 = xp.empty(self.num_features)
            v64 = xp.empty(self.num_features)
            bnk.stats(x, m64, v64, scratch=None if type(x) is np.ndarray else y)
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
        dt = x.dtype
        mean, invstd = stash["mean"], stash["invstd"]
        c = self.num_features
        xp = namespace(x)
        sum_dy = xp.empty(c)
        sum_dy_xmu = xp.empty(c)
        scratch = None
        if type(x) is not np.ndarray:  # a device: the declared workspace, x's size
            scratch = workspace[:x.nbytes].view(dt).reshape(x.shape)
        bnk.reduce(dy, x, mean, sum_dy, sum_dy_xmu, scratch)
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
        bnk.backward_apply(dy, x, mean, k.astype(dt), shift.astype(dt), coef.astype(dt), dx,
                           scratch)

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
