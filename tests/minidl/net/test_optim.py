"""Tests for minidl.net.optim: updates vs torch.optim and hand-written references, state handling,
gradient clipping (the schedules: test_lr_schedules.py)."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from minidl.net.optim import (
    SGD,
    Adam,
    AdamW,
    clip_grad_norm_,
)
from minidl.net.parameter import Parameter

SHAPES = ((3, 4), (5,), (2, 3, 2, 2))

CONFIGS = {
    "sgd": (SGD, dict(lr=0.1)),
    "sgd-momentum": (SGD, dict(lr=0.1, momentum=0.9)),
    "sgd-dampening-wd": (SGD, dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    "sgd-nesterov": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd-nesterov-wd": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.02)),
    "sgd-wd": (SGD, dict(lr=0.1, weight_decay=0.1)),
    "adam": (Adam, dict(lr=1e-2)),
    "adam-wd-betas": (Adam, dict(lr=1e-2, betas=(0.3, 0.9), eps=1e-6, weight_decay=0.1)),
    "adamw": (AdamW, dict(lr=1e-2)),
    "adamw-wd": (AdamW, dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.3)),
}


def _params(seed: int = 0, shapes=SHAPES) -> list[Parameter]:
    rng = np.random.default_rng(seed)
    return [Parameter(f"p{i}", rng.standard_normal(s).astype(np.float32))
            for i, s in enumerate(shapes)]


def _grad_stream(seed: int, steps: int, shapes=SHAPES):
    """Per step, a list of float32 grads; some params skip a step (grad None) as in torch."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(steps):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        if k == 2:
            grads[1] = None
        out.append(grads)
    return out


def _run(opt, params, grads_per_step) -> None:
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.copy()
        opt.step()


# ----------------------------------------------------------------------------- vs torch


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_torch(config):
    torch = pytest.importorskip("torch")
    cls, kw = CONFIGS[config]
    params = _params()
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    topt = getattr(torch.optim, cls.__name__)(tparams, **kw)
    opt = cls(params, **kw)
    grads = _grad_stream(1, 6)
    _run(opt, params, grads)
    for step in grads:
        for t, g in zip(tparams, step, strict=True):
            t.grad = None if g is None else torch.tensor(g.copy())
        topt.step()
    for p, t in zip(params, tparams, strict=True):
        assert p.data.dtype == np.float32
        # PyTorch uses fused multiply-adds: agreement is to float32 rounding, not bitwise.
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-6, atol=1e-6)
    # Torch keeps per-param state under the same names.
    for p, t in zip(params, tparams, strict=True):
        tstate = topt.state[t]
        for slot, tslot in (("momentum", "momentum_buffer"), ("exp_avg", "exp_avg"),
                            ("exp_avg_sq", "exp_avg_sq")):
            if slot in opt.slots:
                np.testing.assert_allclose(opt.state[f"{p.name}.{slot}"],
                                           tstate[tslot].numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_torch_float64(config):
    torch = pytest.importorskip("torch")
    cls, kw = CONFIGS[config]
    params = [Parameter(p.name, p.data.astype(np.float64)) for p in _params()]
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    topt = getattr(torch.optim, cls.__name__)(tparams, **kw)
    opt = cls(params, **kw)
    grads = [[None if g is None else g.astype(np.float64) for g in step]
             for step in _grad_stream(1, 6)]
    _run(opt, params, grads)
    for step in grads:
        for t, g in zip(tparams, step, strict=True):
            t.grad = None if g is None else torch.tensor(g.copy())
        topt.step()
    for p, t in zip(params, tparams, strict=True):
        assert p.data.dtype == np.float64
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-14)


class _Foreign(np.ndarray):
    """Stands for a non-NumPy array type (CuPy): the optimizer takes the ufunc path."""


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_path_bit_identical_to_ufunc_path(config, parallel, monkeypatch):
    """NumPy parameters (fused Numba kernels, serial or chunked over threads) and foreign
    arrays (the ufunc reference, i.e. the implementation before the fused kernels) give the
    same bits, state included."""
    from minidl.kernels.pointwise import optim as kernels

    if parallel:
        monkeypatch.setattr(kernels, "PARALLEL_MIN_SIZE", 0)
        monkeypatch.setattr(kernels, "num_threads", lambda: 2)
    cls, kw = CONFIGS[config]
    fused = _params(2)
    foreign = [Parameter(p.name, p.data.copy().view(_Foreign)) for p in fused]
    a, b = cls(fused, **kw), cls(foreign, **kw)
    b.init_state(lambda name, shape, dtype: np.zeros(shape, dtype).view(_Foreign))
    grads = _grad_stream(3, 5)
    _run(a, fused, grads)
    _run(b, foreign, [[None if g is None else g.view(_Foreign) for g in s] for s in grads])
    for pa, pb in zip(fused, foreign, strict=True):
        assert type(pa.data) is np.ndarray and type(pb.data) is _Foreign
        np.testing.assert_array_equal(pa.data.view(np.uint32), pb.data.view(np.uint32))
    for key, arr in a.state.items():
        np.testing.assert_array_equal(arr.view(np.uint32), b.state[key].view(np.uint32))


# ----------------------------------------------------------------------------- vs formulas


def _reference(cls, kw, params, grads_per_step):
    """The textbook/PyTorch formulas in float64."""
    lr = kw["lr"]
    wd = kw.get("weight_decay", 1e-2 if cls is AdamW else 0.0)
    mom, damp, nest = kw.get("momentum", 0.0), kw.get("dampening", 0.0), kw.get("nesterov", False)
    b1, b2 = kw.get("betas", (0.9, 0.999))
    eps = kw.get("eps", 1e-8)
    xs = [p.data.astype(np.float64) for p in params]
    state: dict[int, dict] = {i: {"t": 0} for i in range(len(xs))}
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            if g is None:
                continue
            x, s, g = xs[i], state[i], g.astype(np.float64)
            s["t"] += 1
            if cls is SGD:
                g = g + wd * x
                if mom:
                    s["buf"] = g.copy() if s["t"] == 1 else mom * s["buf"] + (1 - damp) * g
                    g = g + mom * s["buf"] if nest else s["buf"]
                xs[i] = x - lr * g
            else:
                if cls is AdamW:
                    x = x * (1 - lr * wd)
                else:
                    g = g + wd * x
                s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
                s["v"] = b2 * s.get("v", 0) + (1 - b2) * g * g
                mhat = s["m"] / (1 - b1 ** s["t"])
                denom = np.sqrt(s["v"]) / math.sqrt(1 - b2 ** s["t"]) + eps
                xs[i] = x - lr * mhat / denom
    return xs


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_matches_reference_formulas(config):
    cls, kw = CONFIGS[config]
    params = _params(3)
    grads = _grad_stream(4, 5)
    expected = _reference(cls, kw, params, grads)
    _run(cls(params, **kw), params, grads)
    for p, x in zip(params, expected, strict=True):
        np.testing.assert_allclose(p.data, x, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------- params & state


def test_keeps_trainable_unique_params_and_skips_missing_grads():
    a, b = _params()[:2]
    buf = Parameter("running_mean", np.zeros(3, np.float32), trainable=False)
    opt = SGD([a, buf, a, b], lr=0.5)
    assert opt.params == [a, b]
    a.grad = np.ones_like(a.data)
    before_b = b.data.copy()
    before_a = a.data.copy()
    opt.step()
    np.testing.assert_allclose(a.data, before_a - 0.5)
    np.testing.assert_array_equal(b.data, before_b)
    assert opt.param_steps == {"p0": 1, "p1": 0} and opt.step_count == 1
    with pytest.raises(ValueError, match="unique"):
        SGD([Parameter("w", np.zeros(2, np.float32)), Parameter("w", np.zeros(2, np.float32))],
            lr=0.1)
    with pytest.raises(TypeError):
        SGD([np.zeros(3)], lr=0.1)


def test_zero_grad():
    params = _params()
    params[0].grad = np.ones(params[0].shape, np.float32)
    grad_ref = params[0].grad
    SGD(params, lr=0.1).zero_grad()
    assert params[0].grad is grad_ref and not grad_ref.any()
    assert params[1].grad is None


@pytest.mark.parametrize("config", ["sgd", "sgd-momentum", "sgd-nesterov-wd", "adam", "adamw"])
def test_init_state_uses_allocator(config):
    cls, kw = CONFIGS[config]
    params = _params()
    opt = cls(params, **kw)
    spec = opt.state_spec()
    arena = np.zeros(sum(int(np.prod(s)) for _, s, _ in spec), np.float32)
    calls, offset = [], 0

    def alloc(name, shape, dtype):
        nonlocal offset
        calls.append((name, tuple(shape), np.dtype(dtype)))
        n = int(np.prod(shape))
        view = arena[offset:offset + n].reshape(shape)
        offset += n
        return view

    opt.init_state(alloc)
    assert calls == [(n, tuple(s), d) for n, s, d in spec]
    assert opt.state_bytes() == arena.nbytes
    # One array per parameter and slot, shaped like the parameter; nothing else (no scratch);
    # slot by slot, so that each slot is laid out as the parameters are (one flat update).
    assert [c[0] for c in calls] == [f"{p.name}.{slot}" for slot in opt.slots for p in params]
    for p in params:
        for slot in opt.slots:
            assert np.shares_memory(opt.state[f"{p.name}.{slot}"], arena)
    _run(opt, params, _grad_stream(0, 2))
    if opt.slots:
        assert arena.any()


def test_state_bytes_counts_exactly_torchs_state():
    params = _params()
    numel = sum(int(np.prod(s)) for s in SHAPES)
    assert SGD(params, lr=0.1, weight_decay=0.1).state_bytes() == 0
    assert SGD(params, lr=0.1, momentum=0.9).state_bytes() == 4 * numel
    assert SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1).state_bytes() == (
        4 * numel)
    assert Adam(params).state_bytes() == 4 * 2 * numel
    assert AdamW(params, weight_decay=0.1).state_bytes() == 4 * 2 * numel
    opt = Adam(params)
    _run(opt, params, _grad_stream(0, 1))  # lazily allocated with np.zeros
    assert sum(a.nbytes for a in opt.state.values()) == opt.state_bytes()


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_state_spec_is_torchs_state(config):
    """Names and shapes of the state are those of torch.optim's per-parameter tensors."""
    torch = pytest.importorskip("torch")
    cls, kw = CONFIGS[config]
    params = _params()
    opt = cls(params, **kw)
    spec = opt.state_spec()
    assert all(".scratch" not in name for name, _, _ in spec)
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    topt = getattr(torch.optim, cls.__name__)(tparams, **kw)
    for t in tparams:
        t.grad = torch.ones_like(t)
    topt.step()
    torch_names = {"momentum_buffer": "momentum", "exp_avg": "exp_avg",
                   "exp_avg_sq": "exp_avg_sq"}
    expected = []
    for p, t in zip(params, tparams, strict=True):
        for key, value in topt.state[t].items():
            if isinstance(value, torch.Tensor) and key != "step":
                expected.append((f"{p.name}.{torch_names[key]}", tuple(value.shape), np.float32))
    assert sorted(spec) == sorted(expected)


def test_sgd_without_momentum_has_no_state():
    params = _params()
    opt = SGD(params, lr=0.1, weight_decay=0.01)
    assert opt.slots == () and opt.state_spec() == [] and opt.state_bytes() == 0
    calls = []
    opt.init_state(lambda name, shape, dtype: calls.append(name))
    assert calls == [] and opt.state == {}
    _run(opt, params, _grad_stream(0, 2))
    assert opt.state == {}
    assert opt.state_dict() == {"step": 2, "lr": 0.1, "p0.step": 2, "p1.step": 2, "p2.step": 2}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_state_dict_has_no_scratch(config):
    """Checkpoints hold ``step``, ``lr``, ``{param}.step`` and the slots; they never held
    scratch buffers, so checkpoints written before the fused kernels load unchanged."""
    cls, kw = CONFIGS[config]
    params = _params()
    opt = cls(params, **kw)
    _run(opt, params, _grad_stream(0, 1))
    keys = list(opt.state_dict())
    assert keys == opt.state_dict_keys()
    assert keys == ["step", "lr"] + [k for p in params
                                     for k in [f"{p.name}.step"]
                                     + [f"{p.name}.{s}" for s in opt.slots]]
    assert not any("scratch" in k for k in keys)


def test_checkpoint_keys_written_before_fused_kernels_load():
    """The key layout of an Adam checkpoint from the ufunc/scratch implementation."""
    params = _params()
    old_keys = ["step", "lr", "p0.step", "p0.exp_avg", "p0.exp_avg_sq", "p1.step",
                "p1.exp_avg", "p1.exp_avg_sq", "p2.step", "p2.exp_avg", "p2.exp_avg_sq"]
    rng = np.random.default_rng(0)
    d = {k: 3 for k in old_keys if k.endswith("step")}
    d["lr"] = 0.01
    for p in params:
        d[f"{p.name}.exp_avg"] = rng.standard_normal(p.shape).astype(np.float32)
        d[f"{p.name}.exp_avg_sq"] = np.abs(rng.standard_normal(p.shape)).astype(np.float32)
    opt = Adam(params)
    opt.load_state_dict(d)
    assert sorted(opt.state_dict()) == sorted(old_keys)
    np.testing.assert_array_equal(opt.state["p1.exp_avg_sq"], d["p1.exp_avg_sq"])


def test_mixed_dtypes():
    params = [Parameter("a", np.ones(4, np.float32)), Parameter("b", np.ones(6, np.float64))]
    opt = Adam(params, lr=0.1)
    spec = {n: (s, d) for n, s, d in opt.state_spec()}
    assert spec == {"a.exp_avg": ((4,), np.float32), "a.exp_avg_sq": ((4,), np.float32),
                    "b.exp_avg": ((6,), np.float64), "b.exp_avg_sq": ((6,), np.float64)}
    for p in params:
        p.grad = np.ones_like(p.data)
    opt.step()
    assert params[0].data.dtype == np.float32 and params[1].data.dtype == np.float64
    np.testing.assert_allclose(params[0].data, 0.9, rtol=1e-6)
    np.testing.assert_allclose(params[1].data, 1 - 0.1 / (1 + 1e-8), rtol=1e-15)


def test_init_state_again_moves_state():
    params = _params()
    opt = SGD(params, lr=0.1, momentum=0.9)
    _run(opt, params, _grad_stream(0, 2))
    old = {k: v.copy() for k, v in opt.state.items()}
    opt.init_state(lambda name, shape, dtype: np.zeros(shape, dtype))
    for k, v in old.items():
        np.testing.assert_array_equal(opt.state[k], v)
    with pytest.raises(ValueError, match="expected"):
        opt.init_state(lambda name, shape, dtype: np.zeros((1,), dtype))


@pytest.mark.parametrize("config", ["sgd-momentum", "sgd-dampening-wd", "adam", "adamw-wd"])
def test_state_dict_round_trip(config):
    cls, kw = CONFIGS[config]
    grads = _grad_stream(7, 6)
    a_params = _params()
    a = cls(a_params, **kw)
    _run(a, a_params, grads[:3])
    saved = a.state_dict()
    assert saved["step"] == 3 and saved["lr"] == kw["lr"]
    assert all(isinstance(v, np.ndarray) for k, v in saved.items() if k not in ("step", "lr")
               and not k.endswith(".step"))
    b_params = [Parameter(p.name, p.data.copy()) for p in a_params]
    b = cls(b_params, **kw)
    b.load_state_dict(saved)
    assert b.param_steps == a.param_steps
    _run(a, a_params, grads[3:])
    _run(b, b_params, grads[3:])
    for pa, pb in zip(a_params, b_params, strict=True):
        np.testing.assert_array_equal(pa.data, pb.data)
    # The saved dict is a copy, not a view of live state.
    if a.slots:
        key = f"p0.{a.slots[0]}"
        assert not np.shares_memory(saved[key], a.state[key])


def test_load_state_dict_errors():
    params = _params()
    opt = Adam(params)
    good = opt.state_dict()
    with pytest.raises(KeyError, match="missing"):
        opt.load_state_dict({k: v for k, v in good.items() if k != "p1.exp_avg"})
    with pytest.raises(KeyError, match="unexpected"):
        opt.load_state_dict({**good, "extra": 1})
    bad = dict(good)
    bad["p0.exp_avg_sq"] = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"p0.exp_avg_sq.*\(3, 4\)"):
        opt.load_state_dict(bad)
    opt.load_state_dict({**good, "lr": 0.5})
    assert opt.lr == 0.5


def test_hyperparameter_validation():
    p = _params()
    for bad in (
        lambda: SGD(p, lr=-0.1),
        lambda: SGD(p, lr=0.1, momentum=-1),
        lambda: SGD(p, lr=0.1, weight_decay=-1),
        lambda: SGD(p, lr=0.1, nesterov=True),
        lambda: SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
        lambda: Adam(p, lr=-1),
        lambda: Adam(p, betas=(1.0, 0.9)),
        lambda: Adam(p, betas=(0.9, -0.1)),
        lambda: Adam(p, eps=-1e-8),
        lambda: AdamW(p, weight_decay=-1),
        lambda: SGD(p, lr=float("nan")),
    ):
        with pytest.raises(ValueError):
            bad()
    opt = SGD(p, lr=0.1)
    opt.lr = 0.01
    assert opt.lr == 0.01
    with pytest.raises(ValueError):
        opt.lr = -1.0


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_step_allocates_no_array_memory(config):
    """No NumPy array is allocated by a step (tracemalloc sees NumPy's allocations; that the
    Numba loops allocate nothing is checked in tests/kernels/pointwise/test_optim_kernels.py)."""
    cls, kw = CONFIGS[config]
    shapes = ((256, 256), (64, 64))  # 256 KiB and 16 KiB
    params = _params(0, shapes)
    for p in params:
        p.grad = np.ones(p.shape, np.float32)
    opt = cls(params, **kw)
    opt.step()  # lazy state allocation happens here
    tracemalloc.start()
    try:
        opt.step()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024, peak


# ----------------------------------------------------------------------------- clipping


def test_clip_grad_norm_scales_like_torch():
    params = _params()
    rng = np.random.default_rng(5)
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)
    grads = [p.grad.copy() for p in params]
    expected = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads))
    total = clip_grad_norm_(params, 1.0)
    assert isinstance(total, float)
    assert total == pytest.approx(expected, rel=1e-6)
    coef = 1.0 / (expected + 1e-6)
    for p, g in zip(params, grads, strict=True):
        np.testing.assert_allclose(p.grad, g * coef, rtol=1e-6)
    # Below the threshold: untouched.
    before = [p.grad.copy() for p in params]
    assert clip_grad_norm_(params, 10.0) == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, before, strict=True):
        np.testing.assert_array_equal(p.grad, g)

    torch = pytest.importorskip("torch")
    ts = [torch.tensor(g.copy()) for g in grads]
    for t in ts:
        t.grad = t.clone()
    tnorm = torch.nn.utils.clip_grad_norm_(ts, 1.0)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.copy()
    assert clip_grad_norm_(params, 1.0) == pytest.approx(float(tnorm), rel=1e-6)
    for p, t in zip(params, ts, strict=True):
        np.testing.assert_allclose(p.grad, t.grad.numpy(), rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_clip_grad_norm_nonfinite_is_returned_unscaled(bad):
    params = _params()
    for p in params:
        p.grad = np.ones(p.shape, np.float32)
    params[1].grad[2] = bad
    before = [p.grad.copy() for p in params]
    total = clip_grad_norm_(params + [Parameter("nograd", np.zeros(2, np.float32))], 0.1)
    assert not math.isfinite(total)
    for p, g in zip(params, before, strict=True):
        np.testing.assert_array_equal(p.grad, g)
