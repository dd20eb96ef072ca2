"""Optimizer updates and codecs on the strict CUDA test device
(:mod:`minidl.memory.testing.strict_device`): the same bytes as on NumPy arrays."""

from __future__ import annotations

import gc

import numpy as np
import pytest

strict = pytest.importorskip("minidl.memory.testing.strict_device")
if not strict.cupy_available():
    pytest.skip("the strict device reads CuPy's API from the cupy package", allow_module_level=True)

from strict_mem import DeviceMem, garbage, normal  # noqa: E402

from minidl.layers import ReLU  # noqa: E402


@pytest.fixture(scope="module")
def dev():
    return strict.StrictCudaDevice("64MiB")


# ---------------------------------------------------------------- optimizer updates
def _update_both(dev, fn, arrays: list[np.ndarray], steps: int, **kw) -> None:
    """``fn`` (an update kernel) ``steps`` times on NumPy and on device copies: bit-identical
    (the Numba loops compute exactly what the reference's ufuncs compute)."""
    host = [a.copy() for a in arrays]
    mem = DeviceMem(dev)
    devs = [mem.put(a) for a in arrays]
    calls = dev.checked_calls
    for s in range(steps):
        extra = {"step": s + 1} if "beta1" in kw else {"first_step": s == 0}
        fn(*host, **kw, **extra)
        fn(*devs, **kw, **extra)
    assert dev.checked_calls > calls
    for h, d in zip(host, devs, strict=True):
        np.testing.assert_array_equal(d.get(), h, err_msg=str(kw))
    gc.collect()
    assert dev.default_pool_bytes == 0


@pytest.mark.parametrize("shape", [(), (7,), (3, 50)])
@pytest.mark.parametrize("hyper", [
    {"momentum": 0.0}, {"momentum": 0.0, "weight_decay": 0.01}, {"momentum": 0.9},
    {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    {"momentum": 0.8, "dampening": 0.3, "weight_decay": 1e-3}])
def test_sgd_update(dev, shape, hyper):
    from minidl.kernels.pointwise.optim import sgd_update

    rng = np.random.default_rng(12)
    p, g, buf = (normal(rng, *shape) for _ in range(3))
    _update_both(dev, sgd_update, [p, g, buf], 3, lr=0.05, **hyper)


@pytest.mark.parametrize("shape", [(), (7,), (3, 50)])
@pytest.mark.parametrize("hyper", [{}, {"weight_decay": 0.01},
                                   {"weight_decay": 0.01, "decoupled": True},
                                   {"beta1": 0.3, "beta2": 0.9, "eps": 1e-6}])
def test_adam_update(dev, shape, hyper):
    from minidl.kernels.pointwise.optim import adam_update

    rng = np.random.default_rng(13)
    p, g = (normal(rng, *shape) for _ in range(2))
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    _update_both(dev, adam_update, [p, g, m, v], 3, lr=1e-2, **{"beta1": 0.9, **hyper})


# ---------------------------------------------------------------- codecs
def _codec_round_trip(mem: DeviceMem, codec: str, x: np.ndarray, window: int = 0) -> tuple:
    """Encode on NumPy and on the device (the bytes used must be identical), then decode both
    (identical, NaN included); returns (host buffer, device buffer, host attrs)."""
    from minidl.memory.passes import codecs

    dev = mem.dev
    hbuf, hattrs = np.zeros(x.nbytes + 1024, np.uint8), codecs.CodecState(window=window)
    dbuf, dattrs = mem.put(hbuf), codecs.CodecState(window=window)
    want = codecs.encode(codec, x.copy(), hbuf, hattrs)
    calls = dev.checked_calls
    got = codecs.encode(codec, mem.put(x), dbuf, dattrs)
    assert dev.checked_calls > calls
    assert got == want and vars(dattrs) == vars(hattrs), codec
    np.testing.assert_array_equal(dbuf.get()[:want], hbuf[:want], err_msg=codec)
    assert codecs.density(mem.put(x)) == codecs.density(x)
    if codec not in ("sign", "poolidx"):  # decoded by backward_from_encoded
        hout = np.full_like(x, 7)
        codecs.decode(codec, hbuf, hout, hattrs)
        dout = garbage(mem, x.shape, x.dtype)
        codecs.decode(codec, dbuf, dout, dattrs)
        np.testing.assert_array_equal(dout.get(), hout, err_msg=codec)
    return hbuf, dbuf, hattrs


@pytest.mark.parametrize("codec", ["sign", "sparse", "fp16", "bf16", "fp8"])
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 40, 70)])
def test_codecs(dev, codec, shape):
    rng = np.random.default_rng(14)
    x = rng.standard_normal(shape).astype(np.float32) * 50
    x[rng.random(shape) < 0.7] = 0.0
    x.flat[:4] = [np.inf, -np.nan, -0.0, 1e-42]
    _codec_round_trip(DeviceMem(dev), codec, x)
    gc.collect()
    assert dev.default_pool_bytes == 0


def test_sparse_codec_dense_fallback_and_short_buffer(dev):
    from minidl.memory.passes import codecs

    rng = np.random.default_rng(15)
    x = rng.standard_normal((4, 300)).astype(np.float32)  # no zeros: stored dense
    mem = DeviceMem(dev)
    _, _, state = _codec_round_trip(mem, "sparse", x)
    assert state.fmt == "dense"
    x[:, 5:] = 0.0
    small = mem.put(np.full(16, 0xAB, np.uint8))
    assert codecs.encode("sparse", mem.put(x), small, codecs.CodecState()) > small.size
    assert (small.get() == 0xAB).all()  # nothing written


def test_pool_index_codec(dev):
    rng = np.random.default_rng(16)
    for window in (4, 9):
        idx = rng.integers(0, window, (3, 5, 7)).astype(np.uint8)
        _codec_round_trip(DeviceMem(dev), "poolidx", idx, window)


def test_relu_backward_from_sign_encoding(dev):
    rng = np.random.default_rng(17)
    y = np.maximum(rng.standard_normal((3, 4, 11)).astype(np.float32), 0)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    mem = DeviceMem(dev)
    hbuf, dbuf, _ = _codec_round_trip(mem, "sign", y)
    want = np.empty_like(dy)
    ReLU().backward_from_encoded("sign", hbuf, dy, want)
    got = garbage(mem, dy.shape, dy.dtype)
    ReLU().backward_from_encoded("sign", dbuf, mem.put(dy), got)
    np.testing.assert_array_equal(got.get(), want)
    np.testing.assert_array_equal(want, dy * (y > 0))
