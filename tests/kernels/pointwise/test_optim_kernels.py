"""Fused optimizer kernels of kernels/pointwise/optim.py against their NumPy (ufunc) references:
bit-identical
results for float32 and float64, any shape, serial and parallel loops, and no allocation."""

from __future__ import annotations

import numpy as np
import pytest
from bits import assert_same_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minidl.kernels.pointwise import optim as ko

DTYPES = [np.float32, np.float64]

SGD_DEFAULTS = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # `loops` is the same for every example

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)
# Magnitudes from subnormal to large, so that flush-to-zero or a reordering would show.
scales = st.sampled_from([1.0, 1e-3, 1e3, 1e-40, 1e-310])


def assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns (so -0.0 != 0.0), NaN matching NaN whatever its sign and payload
    (tests/kernels/bits.py says why)."""
    assert_same_bits(got, want)


def _arrays(rng, shape, dtype, scale, k):
    out = []
    for _ in range(k):
        x = np.asarray(rng.standard_normal(shape) * scale).astype(dtype)
        out.append(x)
    return out


@pytest.fixture(params=["serial", "parallel"])
def loops(request, monkeypatch):
    """Run each test with the serial loops and with the chunked parallel loops (every size)."""
    if request.param == "parallel":
        monkeypatch.setattr(ko, "PARALLEL_MIN_SIZE", 0)
        monkeypatch.setattr(ko, "num_threads", lambda: 3)  # more chunks than elements, uneven
    else:
        monkeypatch.setattr(ko, "PARALLEL_MIN_SIZE", 1 << 62)
    return request.param


sgd_hyper = st.fixed_dictionaries({
    "lr": st.sampled_from([0.0, 1e-3, 0.1, 0.7]),
    "momentum": st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    "dampening": st.sampled_from([0.0, 0.1, 0.9]),
    "weight_decay": st.sampled_from([0.0, 1e-4, 5e-4, 0.3]),
    "nesterov": st.booleans(),
})


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(shape=shapes, hyper=sgd_hyper, scale=scales, steps=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_sgd_fused_matches_reference(loops, dtype, shape, hyper, scale, steps, seed):
    if hyper["nesterov"] and (hyper["momentum"] == 0 or hyper["dampening"] != 0):
        hyper["nesterov"] = False  # torch rejects these combinations
    rng = np.random.default_rng(seed)
    p, buf = _arrays(rng, shape, dtype, scale, 2)
    p_ref, buf_ref = p.copy(), buf.copy()
    has_buf = hyper["momentum"] != 0
    for k in range(steps):
        (g,) = _arrays(rng, shape, dtype, scale, 1)
        g_before = g.copy()
        ko.sgd_update(p, g, buf if has_buf else None, **hyper, first_step=k == 0)
        ko.sgd_update_ref(p_ref, g, buf_ref if has_buf else None, **hyper, first_step=k == 0)
        assert_bits_equal(p, p_ref)
        assert_bits_equal(buf, buf_ref)
        assert_bits_equal(g, g_before)  # the gradient is only read


adam_hyper = st.fixed_dictionaries({
    "lr": st.sampled_from([0.0, 1e-3, 1e-2, 0.3]),
    "beta1": st.sampled_from([0.0, 0.3, 0.5, 0.51, 0.9, 0.99]),  # both branches of lerp
    "beta2": st.sampled_from([0.0, 0.9, 0.999, 0.9999]),
    "eps": st.sampled_from([0.0, 1e-8, 1e-6, 0.1]),
    "weight_decay": st.sampled_from([0.0, 1e-2, 0.3]),
    "decoupled": st.booleans(),
})


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE_OK)
@given(shape=shapes, hyper=adam_hyper, scale=scales, first=st.integers(1, 1000),
       steps=st.integers(1, 3), seed=st.integers(0, 2**31))
@np.errstate(all="ignore")  # eps = 0 with v = 0 divides 0 by 0, in both paths alike
def test_adam_fused_matches_reference(loops, dtype, shape, hyper, scale, first, steps, seed):
    rng = np.random.default_rng(seed)
    p, m = _arrays(rng, shape, dtype, scale, 2)
    (v,) = _arrays(rng, shape, dtype, scale, 1)
    v = np.asarray(np.abs(v) * v.dtype.type(scale))  # non-negative, of order g * g
    refs = [p.copy(), m.copy(), v.copy()]
    for step in range(first, first + steps):
        (g,) = _arrays(rng, shape, dtype, scale, 1)
        g_before = g.copy()
        ko.adam_update(p, g, m, v, **hyper, step=step)
        ko.adam_update_ref(*refs[:1], g, *refs[1:], **hyper, step=step)
        for got, want in zip((p, m, v), refs, strict=True):
            assert_bits_equal(got, want)
        assert_bits_equal(g, g_before)


@np.errstate(all="ignore")
def test_edge_values_match_reference(loops):
    """Inf, NaN, signed zeros and a zero denominator (eps = 0, v = 0) go through both paths
    alike."""
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.0, 2.5], np.float32)
    for p0, g0 in ((special, special[::-1].copy()), (special[::-1].copy(), special)):
        for kw in (dict(momentum=0.9, weight_decay=0.1, nesterov=True), dict(weight_decay=0.1),
                   dict(momentum=0.9, dampening=0.5)):
            got, want = p0.copy(), p0.copy()
            bufs = [np.full_like(p0, 0.5), np.full_like(p0, 0.5)]
            for first in (True, False):
                ko.sgd_update(got, g0, bufs[0], 0.1, **kw, first_step=first)
                ko.sgd_update_ref(want, g0, bufs[1], 0.1, **{**SGD_DEFAULTS, **kw},
                                  first_step=first)
                assert_bits_equal(got, want)
                assert_bits_equal(*bufs)
        for decoupled in (False, True):
            got, want = p0.copy(), p0.copy()
            mv = [np.zeros_like(p0) for _ in range(4)]
            for step in (1, 2):
                ko.adam_update(got, g0, mv[0], mv[1], 1e-2, 0.9, 0.999, 0.0, 0.1, step, decoupled)
                ko.adam_update_ref(want, g0, mv[2], mv[3], 1e-2, 0.9, 0.999, 0.0, 0.1, step,
                                   decoupled)
                assert_bits_equal(got, want)
                assert_bits_equal(mv[0], mv[2])
                assert_bits_equal(mv[1], mv[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalars_are_in_the_parameter_dtype(dtype):
    for s in ko.sgd_scalars(dtype, 0.1, 0.9, 0.1, 1e-4):
        assert type(s) is dtype
    scalars = ko.adam_scalars(dtype, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3, True)
    assert type(scalars[2]) is bool
    for s in scalars[:2] + scalars[3:]:
        assert type(s) is dtype
    # weight 1 - beta1 >= 0.5: the high branch of lerp uses 1 - f(w), rounded in the dtype
    low, w = ko.adam_scalars(dtype, 1e-3, 0.3, 0.999, 1e-8, 0.0, 1, False)[2:4]
    assert not low and w == dtype(1) - dtype(0.7)


class _Foreign(np.ndarray):
    """Stands for a non-NumPy array type (CuPy): ufuncs on it return its own type."""


def test_dispatch_falls_back_to_reference_for_other_arrays(loops):
    rng = np.random.default_rng(0)
    base = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(4)]
    base[3] = np.abs(base[3])
    cases = {
        "subclass": lambda a: a.copy().view(_Foreign),
        "non-contiguous": lambda a: np.asfortranarray(a).T.copy().T,
        "strided": lambda a: np.repeat(a, 2, axis=1)[:, ::2],
    }
    for name, make in cases.items():
        p, g, m, v = (make(a) for a in base)
        assert name == "subclass" or not p.flags.c_contiguous
        want = [a.copy() for a in base]
        ko.adam_update(p, g, m, v, 1e-2, weight_decay=0.1, step=3)
        ko.adam_update(want[0], want[1], want[2], want[3], 1e-2, weight_decay=0.1, step=3)
        for got, w in zip((p, m, v), (want[0], want[2], want[3]), strict=True):
            assert_bits_equal(np.ascontiguousarray(got).view(np.ndarray), w)
        p, g, b = (make(a) for a in base[:3])
        want = [a.copy() for a in base[:3]]
        ko.sgd_update(p, g, b, 0.1, momentum=0.9, weight_decay=0.1, nesterov=True)
        ko.sgd_update(*want, 0.1, momentum=0.9, weight_decay=0.1, nesterov=True)
        assert_bits_equal(np.ascontiguousarray(p).view(np.ndarray), want[0])
        assert_bits_equal(np.ascontiguousarray(b).view(np.ndarray), want[2])
    # mixed dtypes go to the reference too (which casts into the parameter's dtype)
    p = base[0].copy()
    ko.sgd_update(p, base[1].astype(np.float64), None, 0.5)
    np.testing.assert_allclose(p, base[0] - np.float32(0.5) * base[1], rtol=1e-6)


def test_reference_temporaries_are_of_the_operands_type():
    """The ufunc path allocates its temporaries through the operands' array library: with a
    foreign array type every temporary is of that type (CuPy's allocator, on the cuda device),
    and there are at most two."""
    made: list[np.ndarray] = []

    class Tracking(np.ndarray):
        def __array_finalize__(self, obj):
            made.append(self)

    operands = [np.ones(8, np.float32).view(Tracking) for _ in range(4)]

    def temporaries() -> set[int]:
        new = [a for a in made if not any(np.shares_memory(a, x) for x in operands)]
        assert all(type(a) is Tracking for a in new)
        return {a.__array_interface__["data"][0] for a in new}

    p, g, m, v = operands
    made.clear()
    ko.adam_update(p, g, m, v, 1e-2, weight_decay=0.1, step=1)
    assert 1 <= len(temporaries()) <= 2
    made.clear()
    ko.sgd_update(p, g, m, 0.1, momentum=0.9, weight_decay=0.1, nesterov=True)
    assert 1 <= len(temporaries()) <= 2


def test_fused_kernels_allocate_no_arrays(loops):
    """Inside the Numba loops nothing is allocated: NRT only wraps each array argument
    (a MemInfo around the caller's buffer), even in the chunked parallel loops."""
    from numba.core.runtime import _nrt_python as nrt
    from numba.core.runtime import rtsys

    n = 1000
    p, g, b, v = (np.ones(n, np.float32) for _ in range(4))
    calls = [
        (lambda: ko.sgd_update(p, g, None, 0.1, weight_decay=0.1), 2),
        (lambda: ko.sgd_update(p, g, b, 0.1, momentum=0.9, nesterov=True), 3),
        (lambda: ko.adam_update(p, g, b, v, 1e-3, weight_decay=0.1, step=2), 4),
    ]
    for call, _ in calls:
        call()  # compile
    was_enabled = nrt.memsys_stats_enabled()
    nrt.memsys_enable_stats()
    try:
        for call, n_arrays in calls:
            before = rtsys.get_allocation_stats()
            call()
            after = rtsys.get_allocation_stats()
            assert after.alloc - before.alloc <= n_arrays
            assert after.alloc - before.alloc == after.free - before.free
    finally:
        if not was_enabled:
            nrt.memsys_disable_stats()


def test_parallel_chunks_cover_every_element(monkeypatch):
    monkeypatch.setattr(ko, "PARALLEL_MIN_SIZE", 0)
    for threads in (2, 3, 7):
        monkeypatch.setattr(ko, "num_threads", lambda threads=threads: threads)
        for n in (1, 2, 5, 6, 7, 1001):
            p = np.zeros(n, np.float32)
            ko.sgd_update(p, np.ones(n, np.float32), None, 1.0)
            assert (p == -1).all()
            m, v = np.zeros(n), np.zeros(n)
            q = np.zeros(n)
            ko.adam_update(q, np.ones(n), m, v, 1.0, step=1)
            assert (m != 0).all() and (v != 0).all() and (q != 0).all()
