"""The CUDA kernels of batch normalisation (minidl.kernels.normalization.batchnorm) and softmax
cross-entropy
(minidl.kernels.pointwise.softmax_xent), without a GPU.

``CUDA_LAUNCH_CASES`` launch every kernel on emulated device arrays (one host thread, see
``_cuda``) and compare with the CPU path: the apply kernels and the per-channel bookkeeping
bit for bit (the same operations), the float64 reductions within 1e-12, the loss within
float32 rounding (the host sums in float32). test_cuda_ptx.py compiles every signature they
launch; test_cuda_sim.py runs the kernels with several threads and blocks.

On the strict CUDA test device, one forward or backward of BatchNorm (training, eval,
``momentum=None``, without affine parameters or running statistics, accumulating gradients)
or of SoftmaxCrossEntropy with ``device_kernels`` (with and without label smoothing) makes at
most :data:`MAX_LAUNCHES` launches, no host synchronisation and no temporary array, and equals
the CPU's within 1e-5; sync-BN's device path equals the CPU's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from emulated_arrays import D, H, same

from minidl.kernels.normalization import batchnorm as bnk
from minidl.kernels.pointwise import softmax_xent as sx
from minidl.layers import BatchNorm1d, BatchNorm2d, Context, SoftmaxCrossEntropy

# ----------------------------------------------------------------------------- emulated arrays


def close(got: np.ndarray, want: np.ndarray, rtol: float, scale: float | None = None) -> None:
    """Equal within ``rtol`` of each value, or of ``scale`` (default: the largest |value|)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if scale is None:
        finite = np.abs(want[np.isfinite(want)])
        scale = float(finite.max()) if finite.size else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


DTYPES = (np.float32, np.float64)
#: (N, C, S): several channels, one value per channel row, S = 1 (BatchNorm1d on (N, C))
BN_SHAPES = ((2, 3, 5), (4, 1, 1), (3, 7, 1), (2, 2, 300))


# ----------------------------------------------------------------------------- batch norm
def _bn_finalize_ref(m64, v64, eps, dt, weight=None, bias=None, running=None, momentum=0.1,
                     unbias=1.0):
    """The layer's host bookkeeping: stash mean / invstd, scale / shift, running update."""
    mean, invstd = m64.astype(dt), (1.0 / np.sqrt(v64.astype(np.float64) + eps)).astype(dt)
    scale = invstd if weight is None else (weight * invstd).astype(dt)
    shift = np.zeros_like(invstd) if bias is None else bias.astype(dt)
    if running is not None:
        rm, rv, tracked = running
        tracked += 1
        mom = 1.0 / float(tracked) if momentum is None else momentum
        rm[...] = (1.0 - mom) * rm + mom * m64
        rv[...] = (1.0 - mom) * rv + mom * v64 * unbias
    return mean, invstd, scale, shift


def case_bn_forward(rng: np.random.Generator) -> None:
    """Statistics, finalize (batch and running statistics, affine or not, momentum or the
    cumulative average) and apply (also in place) against the CPU path."""
    for dt in DTYPES:
        for shape in BN_SHAPES:
            n, c, s = shape
            x = (rng.standard_normal(shape) * 3 + 1).astype(dt)
            m_cpu, v_cpu = np.empty(c), np.empty(c)
            bnk.stats(x, m_cpu, v_cpu)
            m_dev, v_dev = D(np.full(c, np.nan)), D(np.full(c, np.nan))
            bnk.stats(D(x), m_dev, v_dev)
            close(H(m_dev), m_cpu, 1e-12)
            close(H(v_dev), v_cpu, 1e-12)
            weight, bias = (rng.uniform(0.5, 2, c).astype(dt) for _ in range(2))
            for affine in (True, False):
                for momentum, tracked0 in ((0.1, 3), (None, 0), (None, 5)):
                    rm0, rv0 = rng.standard_normal(c).astype(dt), rng.uniform(0.5, 2, c).astype(dt)
                    rm, rv, tracked = rm0.copy(), rv0.copy(), np.array(tracked0, np.int64)
                    wb = (weight, bias) if affine else (None, None)
                    unbias = n * s / (n * s - 1) if n * s > 1 else 1.0
                    want = _bn_finalize_ref(m_cpu, v_cpu, 1e-5, dt, *wb,
                                            running=(rm, rv, tracked), momentum=momentum,
                                            unbias=unbias)
                    outs = [D(np.full(c, np.nan, dt)) for _ in range(4)]
                    d_rm, d_rv, d_tr = D(rm0), D(rv0), D(np.array(tracked0, np.int64))
                    bnk.finalize_device(D(m_cpu), D(v_cpu), 1e-5, *outs,
                                        weight=None if wb[0] is None else D(wb[0]),
                                        bias=None if wb[1] is None else D(wb[1]),
                                        running_mean=d_rm, running_var=d_rv, tracked=d_tr,
                                        momentum=momentum, unbias=unbias, update=True)
                    for got, w in zip(outs, want, strict=True):
                        same(H(got), w)
                    # the host rounds (1 - momentum) * running to float32 first
                    close(H(d_rm), rm, 1e-6 if dt == np.float32 else 1e-14)
                    close(H(d_rv), rv, 1e-6 if dt == np.float32 else 1e-14)
                    assert int(H(d_tr)) == tracked0 + 1
                # running statistics (eval), nothing updated; no counter (no tracking)
                rm, rv = rng.standard_normal(c).astype(dt), rng.uniform(0.5, 2, c).astype(dt)
                want = _bn_finalize_ref(rm, rv, 1e-3, dt, *((weight, bias) if affine
                                                           else (None, None)))
                outs = [D(np.full(c, np.nan, dt)) for _ in range(4)]
                d_tr = D(np.array(7, np.int64))
                bnk.finalize_device(D(rm), D(rv), 1e-3, *outs,
                                    weight=D(weight) if affine else None,
                                    bias=D(bias) if affine else None, tracked=d_tr)
                for got, w in zip(outs, want, strict=True):
                    same(H(got), w)
                assert int(H(d_tr)) == 7
                outs = [D(np.full(c, np.nan, dt)) for _ in range(4)]
                bnk.finalize_device(D(m_cpu), D(v_cpu), 1e-5, *outs)
                for got, w in zip(outs, _bn_finalize_ref(m_cpu, v_cpu, 1e-5, dt), strict=True):
                    same(H(got), w)
            mean, scale, shift = (rng.standard_normal(c).astype(dt) for _ in range(3))
            y = np.empty_like(x)
            bnk.apply(x, mean, scale, shift, y)
            y_dev = D(np.full(shape, np.nan, dt))
            bnk.apply(D(x), D(mean), D(scale), D(shift), y_dev)
            same(H(y_dev), y)
            x_dev = D(x)
            bnk.apply(x_dev, D(mean), D(scale), D(shift), x_dev)  # in place
            same(H(x_dev), y)


def _bn_backward_ref(sum_dy, sum_dy_xmu, invstd, dt, weight, count, batch_stats,
                     norm=None):
    """The layer's host formulas: dgamma, and k / shift / coef in the compute dtype."""
    inv64 = invstd.astype(np.float64)
    dgamma = sum_dy_xmu * inv64
    k = (1.0 if weight is None else weight.astype(np.float64)) * inv64
    n_dy, n_xmu = (sum_dy, sum_dy_xmu) if norm is None else norm
    if batch_stats:
        shift, coef = n_dy / count, inv64 * (n_xmu * inv64) / count
    else:
        shift, coef = np.zeros_like(inv64), np.zeros_like(inv64)
    return dgamma, k.astype(dt), shift.astype(dt), coef.astype(dt)


def case_bn_backward(rng: np.random.Generator) -> None:
    """The sums, the gradients (written, added, absent) with dx's coefficients, and dx (also
    in place) against the CPU path."""
    for dt in DTYPES:
        for shape in BN_SHAPES:
            n, c, s = shape
            x = (rng.standard_normal(shape) * 2 + 1).astype(dt)
            dy = rng.standard_normal(shape).astype(dt)
            mean = rng.standard_normal(c).astype(dt)
            sums = np.empty(c), np.empty(c)
            bnk.reduce(dy, x, mean, *sums)
            d_sums = D(np.full(c, np.nan)), D(np.full(c, np.nan))
            bnk.reduce(D(dy), D(x), D(mean), *d_sums)
            for got, want in zip(d_sums, sums, strict=True):
                close(H(got), want, 1e-12)
            invstd, weight = (rng.uniform(0.5, 2, c).astype(dt) for _ in range(2))
            norm = rng.standard_normal(c), rng.standard_normal(c)
            for affine, batch_stats, use_norm, accumulate in (
                    (True, True, False, ()), (True, True, True, ("weight",)),
                    (False, True, False, ()), (True, False, False, ("weight", "bias"))):
                grads = [rng.standard_normal(c).astype(dt) for _ in range(2)]
                dgamma, *want = _bn_backward_ref(*sums, invstd, dt, weight if affine else None,
                                                 n * s, batch_stats, norm if use_norm else None)
                outs = [D(np.full(c, np.nan, dt)) for _ in range(3)]
                d_grads = [D(g) for g in grads] if affine else [None, None]
                bnk.backward_finalize_device(
                    *(D(a) for a in sums), D(invstd), *outs,
                    weight=D(weight) if affine else None, grad_weight=d_grads[0],
                    grad_bias=d_grads[1], accumulate=accumulate,
                    norm_dy=D(norm[0]) if use_norm else None,
                    norm_dy_xmu=D(norm[1]) if use_norm else None, count=float(n * s),
                    batch_stats=batch_stats)
                for got, w in zip(outs, want, strict=True):
                    same(H(got), w)
                if affine:
                    for g0, d_g, new, key in zip(grads, d_grads, (dgamma, sums[0]),
                                                 ("weight", "bias"), strict=True):
                        g = g0.copy()
                        if key in accumulate:
                            g += new
                        else:
                            g[...] = new
                        same(H(d_g), g)
            k, shift, coef = (rng.standard_normal(c).astype(dt) for _ in range(3))
            dx = np.empty_like(x)
            bnk.backward_apply(dy, x, mean, k, shift, coef, dx)
            d_dx = D(np.full(shape, np.nan, dt))
            bnk.backward_apply(D(dy), D(x), D(mean), D(k), D(shift), D(coef), d_dx)
            same(H(d_dx), dx)
            d_dy = D(dy)
            bnk.backward_apply(d_dy, D(x), D(mean), D(k), D(shift), D(coef), d_dy)  # in place
            same(H(d_dy), dx)


# ----------------------------------------------------------------------------- softmax xent
def _logits(rng: np.random.Generator, m: int, k: int, dt) -> np.ndarray:
    """Normal logits with a large-valued row, ties, -inf entries and, for k > 2, a NaN row."""
    x = rng.standard_normal((m, k)) * 2
    if m > 1:
        x[1] *= 300  # exp overflows without the max
    if m > 2 and k > 1:
        x[2, : k // 2 + 1] = 1.5  # ties at the max
        x[2, k - 1] = -np.inf
    if m > 3 and k > 2:
        x[3, 1] = np.nan
    return x.astype(dt)


def _xent_host(x: np.ndarray, t: np.ndarray, eps: float, g: np.ndarray):
    """The layer's host forward (the loss) and backward (d / logits) on NumPy arrays."""
    layer = SoftmaxCrossEntropy(eps)
    ws = np.empty(layer.forward_workspace_bytes([x.shape, t.shape], x.dtype), np.uint8)
    loss = np.empty((), x.dtype)
    with np.errstate(invalid="ignore"):
        layer.forward(Context(), [x, t], [loss], {}, {}, ws)
        dx = np.empty_like(x)
        layer.backward(Context(), [g], [dx, None], [x, t], [loss], {}, {}, {}, None)
    return loss, dx


def case_softmax_xent(rng: np.random.Generator) -> None:
    """Forward (rows' losses, their mean) and backward against the layer's host path, with
    and without label smoothing; a target out of range gives a NaN loss on the device."""
    for dt in DTYPES:
        rtol = 2e-6 if dt == np.float32 else 1e-12
        for m, k in ((1, 1), (5, 7), (6, 300), (3, 2)):
            x = _logits(rng, m, k, dt)
            t = rng.integers(0, k, m).astype(np.int32 if k == 7 else np.int64)
            g = np.array(rng.uniform(0.5, 2), dt)
            for eps in (0.0, 0.1):
                loss, dx = _xent_host(x, t, eps, g)
                d_loss, d_nll = D(np.full((), np.nan, dt)), D(np.full(m, 7.0))
                sx.forward_device(D(x), D(t), eps, d_nll, d_loss)
                close(H(d_loss), loss, rtol)
                d_dx = D(np.full((m, k), np.nan, dt))
                sx.backward_device(D(x), D(t), D(g), eps, d_dx)
                grad_scale = float(g) / m  # the largest |gradient| possible
                close(H(d_dx), dx, rtol, grad_scale)
                d_x = D(x)
                sx.backward_device(d_x, D(t), D(g), eps, d_x)  # in place
                close(H(d_x), dx, rtol, grad_scale)
        # no rows: NaN; a target out of range: that row's loss is NaN, its gradient keeps no
        # target term (nothing read out of bounds)
        d_loss = D(np.zeros((), dt))
        sx.forward_device(D(np.zeros((0, 4), dt)), D(np.zeros(0, np.int64)), 0.0,
                          D(np.zeros(0)), d_loss)
        assert np.isnan(H(d_loss))
        x, t, g = rng.standard_normal((2, 3)).astype(dt), np.array([1, 3]), np.array(1.0, dt)
        d_nll, d_loss = D(np.zeros(2)), D(np.zeros((), dt))
        sx.forward_device(D(x), D(t), 0.0, d_nll, d_loss)
        assert np.isfinite(H(d_nll)[0]) and np.isnan(H(d_nll)[1]) and np.isnan(H(d_loss))
        d_dx = D(np.zeros((2, 3), dt))
        sx.backward_device(D(x), D(t), D(g), 0.0, d_dx)
        p = np.exp(x[1].astype(np.float64) - x[1].max())
        close(H(d_dx)[1], (p / p.sum() / 2).astype(dt), rtol)


CUDA_LAUNCH_CASES = {"bn_forward": case_bn_forward, "bn_backward": case_bn_backward,
                     "softmax_xent": case_softmax_xent}


@pytest.mark.parametrize("name", sorted(CUDA_LAUNCH_CASES))
def test_emulated_kernels_match_the_cpu(name):
    with np.errstate(invalid="ignore", over="ignore"):
        CUDA_LAUNCH_CASES[name](np.random.default_rng(0))


# ----------------------------------------------------------------------------- strict device
#: Most launches one forward or one backward of the layers makes on a device.
MAX_LAUNCHES = 4


def _strict_device():
    strict = pytest.importorskip("minidl.memory.testing.strict_device")
    if not strict.cupy_available():
        pytest.skip("the strict device reads CuPy's API from the cupy package")
    return strict.StrictCudaDevice("16MiB")


class _Arena:
    """Arrays of a strict device: views of its arena at 512-byte aligned offsets."""

    def __init__(self, dev) -> None:
        self.dev, self.offset = dev, 0

    def empty(self, shape, dtype, fill=np.nan):
        """A view filled with ``fill`` (garbage the layer must overwrite)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        v = self.dev.view(self.offset, nbytes, tuple(shape), dtype)
        self.dev.fill(self.offset, nbytes, fill if np.dtype(dtype).kind == "f" else 0xFF)
        self.offset += -(-max(nbytes, 1) // 512) * 512
        return v

    def put(self, host: np.ndarray):
        v = self.empty(host.shape, host.dtype)
        self.dev.copy_from_host(v, host)
        return v


class _HostArena:
    """NumPy arrays, as _Arena makes device ones."""

    def empty(self, shape, dtype, fill=np.nan):
        if np.dtype(dtype).kind == "f":
            return np.full(shape, fill, dtype)
        return np.full(math.prod(shape) * np.dtype(dtype).itemsize, 0xFF, np.uint8).view(
            dtype).reshape(shape)

    def put(self, host: np.ndarray) -> np.ndarray:
        return host.copy()


def _call(layer, ctx, inputs, params, grad, dev=None) -> tuple[dict, list]:
    """One forward and backward of ``layer``, on NumPy arrays or (``dev``) on strict device
    arrays: every result on the host, and the launches / host synchronisations of each."""
    mem = _HostArena() if dev is None else _Arena(dev)
    shapes = [x.shape for x in inputs]
    dt = np.dtype(inputs[0].dtype)
    opts = {"options": {"device_kind": "cpu" if dev is None else "cuda"}}
    xs = [mem.put(x) for x in inputs]
    ps = {k: mem.put(v) for k, v in params.items()}
    ys = [mem.empty(s, dt) for s in layer.output_shapes(shapes)]
    stash = {k: mem.empty(s, d) for k, (s, d) in layer.stash_specs(shapes, dt, **opts).items()}
    ws = [mem.empty((n,), np.uint8, 0xFF) if n else None for n in (
        layer.forward_workspace_bytes(shapes, dt, **opts),
        layer.backward_workspace_bytes(shapes, dt, **opts))]
    dys = [mem.put(grad)]
    dx = mem.empty(shapes[0], dt)
    specs = layer.param_specs()
    grads = {k: mem.put(np.full(v.shape, 0.25, v.dtype)) for k, v in params.items()
             if specs[k].trainable}
    counts = []
    for phase in ("forward", "backward"):
        before = (dev.launches, dev.host_syncs) if dev is not None else (0, 0)
        if phase == "forward":
            layer.forward(ctx, xs, ys, ps, stash, ws[0])
        else:
            layer.backward(ctx, dys, [dx] + [None] * (len(xs) - 1), xs, ys, ps, grads, stash,
                           ws[1])
        if dev is not None:
            counts.append((phase, dev.launches - before[0], dev.host_syncs - before[1]))
    get = (lambda a: a.copy()) if dev is None else (lambda a: a.get())
    out = {"y": get(ys[0]), "dx": get(dx)}
    out.update({f"stash.{k}": get(v) for k, v in stash.items()})
    out.update({f"param.{k}": get(v) for k, v in ps.items()})
    out.update({f"grad.{k}": get(v) for k, v in grads.items()})
    return out, counts


def _bn_params(layer, rng) -> dict:
    params = {}
    for name, spec in layer.param_specs().items():
        if name == "num_batches_tracked":
            params[name] = np.array(4, np.int64)
        elif name == "running_var":
            params[name] = rng.uniform(0.5, 2.0, spec.shape).astype(np.float32)
        else:
            params[name] = rng.standard_normal(spec.shape).astype(np.float32)
    return params


def _bn_cases():
    """(name, layer, context, input shape): resnet8's BatchNorm2d and the variants."""
    train, evaluate = Context(training=True), Context(training=False)
    for name, make, shape in (("BatchNorm2d", lambda: BatchNorm2d(8), (4, 8, 8, 8)),
                              ("momentum=None", lambda: BatchNorm2d(8, momentum=None),
                               (4, 8, 8, 8)),
                              ("BatchNorm1d untracked", lambda: BatchNorm1d(
                                  5, affine=False, track_running_stats=False), (6, 5))):
        for ctx in (train, evaluate):
            yield f"{name} {'training' if ctx.training else 'eval'}", make(), ctx, shape
    yield "BatchNorm2d accumulating", BatchNorm2d(8), Context(accumulate=frozenset(
        {"weight", "bias"})), (4, 8, 8, 8)


@pytest.mark.parametrize("case", list(_bn_cases()), ids=lambda c: c[0])
def test_batchnorm_on_the_strict_device_launches_at_most_four(case):
    """Forward and backward: at most four launches each, no host synchronisation, no array
    made (CuPy's pool, outside the arena, never holds a byte), and the CPU's results."""
    _, layer, ctx, shape = case
    dev = _strict_device()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    params, dy = _bn_params(layer, rng), rng.standard_normal(shape).astype(np.float32)
    want, _ = _call(layer, ctx, [x], params, dy)
    got, counts = _call(layer, ctx, [x], params, dy, dev)
    for phase, launches, syncs in counts:
        assert launches <= MAX_LAUNCHES and syncs == 0, (phase, launches, syncs)
    assert dev.default_pool_peak == 0, "a temporary array"
    for k, w in want.items():
        if w.dtype.kind == "f":
            close(got[k], w, 1e-5)
        else:
            same(got[k], w)
    if ctx.training and "param.num_batches_tracked" in want:
        assert int(got["param.num_batches_tracked"]) == 5


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("lead", [(4,), (2, 3)])
def test_softmax_cross_entropy_kernels_on_the_strict_device_launch_at_most_four(eps, lead,
                                                                               monkeypatch):
    """The layer with its device kernels (``device_kernels``): at most four launches each way
    (two and one), no host synchronisation, no array made, the CPU's results within 1e-6."""
    monkeypatch.setattr(SoftmaxCrossEntropy, "device_kernels", True)
    dev = _strict_device()
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((*lead, 10)) * 2).astype(np.float32)
    t = rng.integers(0, 10, lead)
    g = np.array(0.7, np.float32)
    layer = SoftmaxCrossEntropy(eps)
    want, _ = _call(layer, Context(), [x, t], {}, g)
    got, counts = _call(layer, Context(), [x, t], {}, g, dev)
    for phase, launches, syncs in counts:
        assert launches <= MAX_LAUNCHES and syncs == 0, (phase, launches, syncs)
    assert dev.default_pool_peak == 0, "a temporary array"
    close(got["y"], want["y"], 1e-6)
    close(got["dx"], want["dx"], 1e-6, float(g) / math.prod(lead))


class _TwoEqualRanks:
    """``Context.batch_sync`` of two ranks holding the same batch: each sum doubles."""

    share = 0.5

    def sum(self, values) -> None:
        values *= 2.0


@pytest.mark.parametrize("training", [True, False])
def test_sync_batchnorm_on_the_strict_device_equals_the_cpu(training):
    """Sync-BN's device path (its collectives keep array operations) against the CPU's."""
    dev = _strict_device()
    rng = np.random.default_rng(5)
    layer = BatchNorm2d(8)
    x = (rng.standard_normal((4, 8, 3, 3)) * 3 + 1).astype(np.float32)
    params, dy = _bn_params(layer, rng), rng.standard_normal(x.shape).astype(np.float32)
    ctx = Context(training=training, batch_sync=_TwoEqualRanks())
    want, _ = _call(layer, ctx, [x], params, dy)
    got, _ = _call(layer, ctx, [x], params, dy, dev)
    for k, w in want.items():
        if w.dtype.kind == "f":
            close(got[k], w, 1e-5)
        else:
            same(got[k], w)
