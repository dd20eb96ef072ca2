"""Pool kernels: Numba max / average pooling against the NumPy references (and PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minidl.kernels.pooling import pool as P


@st.composite
def pool_cases(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    hw = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    ho, wo = P.pool_output_hw(hw, kernel, stride, padding)
    assume(ho >= 1 and wo >= 1)
    shape = (draw(st.integers(1, 3)), draw(st.integers(1, 3)), *hw)
    return dict(shape=shape, kernel=kernel, stride=stride, padding=padding, threads=None,
                seed=draw(st.integers(0, 2**31)), ties=draw(st.booleans()))


def _input(case, dtype=np.float64):
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal(case["shape"])
    if case["ties"]:
        x = np.round(x)  # many equal values: the first maximum must win
    return x.astype(dtype)


@settings(max_examples=40, deadline=None)
@given(case=pool_cases())
def test_maxpool_matches_reference(case):
    x = _input(case)
    geom = (case["kernel"], case["stride"], case["padding"])
    y_ref, i_ref = P.maxpool2d_forward_ref(x, *geom)
    y = np.full(y_ref.shape, np.nan)
    idx = np.full(y_ref.shape, 255, P.argmax_dtype(case["kernel"]))
    P.maxpool2d_forward(x, y, idx, *geom, threads=case["threads"])
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(idx, i_ref)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx = np.full(x.shape, np.nan)
    P.maxpool2d_backward(dy, idx, dx, *geom, threads=case["threads"])
    np.testing.assert_allclose(dx, P.maxpool2d_backward_ref(dy, i_ref, x.shape, *geom),
                               rtol=1e-15, atol=0)


@settings(max_examples=30, deadline=None)
@given(case=pool_cases())
def test_avgpool_matches_reference(case):
    x = _input(case)
    geom = (case["kernel"], case["stride"], case["padding"])
    y_ref = P.avgpool2d_forward_ref(x, *geom)
    y = np.full(y_ref.shape, np.nan)
    P.avgpool2d_forward(x, y, *geom, threads=case["threads"])
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-14)
    dy = np.random.default_rng(1).standard_normal(y.shape)
    dx = np.full(x.shape, np.nan)
    P.avgpool2d_backward(dy, dx, *geom, threads=case["threads"])
    np.testing.assert_allclose(dx, P.avgpool2d_backward_ref(dy, x.shape, *geom),
                               rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (2, 3, 9, 7)])
def test_maxpool_2x2_fast_path_nan_and_float32(shape):
    """The vectorised 2x2/2 path: float32, NaN propagation (last NaN wins, as PyTorch)."""
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x[0, 0, 1, 1] = np.nan
    x[1, 2, 2:4, 2:4] = np.nan
    x[1, 1, 4, 4] = -np.inf
    y_ref, i_ref = P.maxpool2d_forward_ref(x, (2, 2), (2, 2))
    y = np.empty_like(y_ref)
    idx = np.empty(y.shape, np.uint8)
    P.maxpool2d_forward(x, y, idx, (2, 2), (2, 2))
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(idx, i_ref)
    assert idx[1, 2, 1, 1] == 3
    dy = np.ones_like(y)
    dx = np.full(x.shape, np.nan, np.float32)
    P.maxpool2d_backward(dy, idx, dx, (2, 2), (2, 2))
    np.testing.assert_array_equal(dx, P.maxpool2d_backward_ref(dy, idx, x.shape, (2, 2), (2, 2)))


@pytest.mark.parametrize("kernel,stride,padding", [((2, 2), (2, 2), (0, 0)),
                                                   ((3, 3), (2, 2), (1, 1))])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_float32(kernel, stride, padding, threads):
    """The parallel launch (forced by ``threads``) cuts planes into chunks: same results."""
    case = dict(shape=(3, 5, 12, 10), kernel=kernel, stride=stride, padding=padding,
                threads=threads, seed=7, ties=True)
    x = _input(case, np.float32)
    geom = (kernel, stride, padding)
    y_ref, i_ref = P.maxpool2d_forward_ref(x, *geom)
    y, idx = np.empty_like(y_ref), np.empty_like(i_ref)
    P.maxpool2d_forward(x, y, idx, *geom, threads=threads)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(idx, i_ref)
    dx = np.empty_like(x)
    P.maxpool2d_backward(y, idx, dx, *geom, threads=threads)
    np.testing.assert_array_equal(dx, P.maxpool2d_backward_ref(y, i_ref, x.shape, *geom))
    ya = np.empty_like(y)
    P.avgpool2d_forward(x, ya, *geom, threads=threads)
    np.testing.assert_allclose(ya, P.avgpool2d_forward_ref(x, *geom), rtol=1e-6, atol=1e-6)
    P.avgpool2d_backward(ya, dx, *geom, threads=threads)
    np.testing.assert_allclose(dx, P.avgpool2d_backward_ref(ya, x.shape, *geom), rtol=1e-6,
                               atol=1e-6)


def test_argmax_dtype():
    assert P.argmax_dtype((2, 2)) == np.uint8
    assert P.argmax_dtype((16, 16)) == np.uint8
    assert P.argmax_dtype((16, 17)) == np.uint16


def test_non_contiguous_outputs():
    x = np.random.default_rng(0).standard_normal((2, 3, 6, 6))
    y = np.empty((2, 3, 3, 3, 2))[..., 0]
    idx = np.empty((2, 3, 3, 3, 2), np.uint8)[..., 1]
    P.maxpool2d_forward(x.transpose(0, 1, 3, 2), y, idx, (2, 2), (2, 2))
    y_ref, i_ref = P.maxpool2d_forward_ref(x.transpose(0, 1, 3, 2), (2, 2), (2, 2))
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(idx, i_ref)
    dx = np.empty((2, 3, 6, 6, 2))[..., 0]
    P.maxpool2d_backward(y, idx, dx, (2, 2), (2, 2))
    np.testing.assert_array_equal(dx, P.maxpool2d_backward_ref(y, i_ref, x.shape, (2, 2), (2, 2)))


@pytest.mark.parametrize("kernel,stride,padding", [((2, 2), (2, 2), (0, 0)),
                                                   ((3, 3), (2, 2), (1, 1)),
                                                   ((3, 2), (1, 2), (1, 0))])
def test_reference_matches_torch(kernel, stride, padding):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal((2, 3, 9, 8))
    yt, it = torch.nn.functional.max_pool2d(torch.from_numpy(x), kernel, stride, padding,
                                            return_indices=True)
    y, idx = P.maxpool2d_forward_ref(x, kernel, stride, padding)
    np.testing.assert_array_equal(y, yt.numpy())
    # torch's index is flat in the unpadded input; rebuild ours
    ho, wo = y.shape[2:]
    i, j = np.divmod(idx.astype(np.int64), kernel[1])
    rows = np.arange(ho)[:, None] * stride[0] - padding[0] + i
    cols = np.arange(wo)[None, :] * stride[1] - padding[1] + j
    np.testing.assert_array_equal(rows * x.shape[3] + cols, it.numpy())
    ya = torch.nn.functional.avg_pool2d(torch.from_numpy(x), kernel, stride, padding)
    np.testing.assert_allclose(P.avgpool2d_forward_ref(x, kernel, stride, padding), ya.numpy(),
                               rtol=1e-12)


CUDA_SIM_SCRIPT = """
import numpy as np
from numba import config, cuda
from minidl.kernels.pooling import pool as P
assert config.ENABLE_CUDASIM
rng = np.random.default_rng(0)
for dt in (np.float32, np.float64):
    for k, s, pad, hw in [((2, 2), (2, 2), (0, 0), (6, 7)), ((3, 3), (2, 2), (1, 1), (7, 6)),
                          ((3, 2), (1, 2), (1, 0), (5, 6))]:
        x = np.round(rng.standard_normal((2, 2, *hw)) * 2).astype(dt)  # ties
        x[0, 0, 1, 1] = np.nan
        y_ref, i_ref = P.maxpool2d_forward_ref(x, k, s, pad)
        y = cuda.device_array(y_ref.shape, dt)
        idx = cuda.device_array(y_ref.shape, np.uint8)
        P.maxpool2d_forward(cuda.to_device(x), y, idx, k, s, pad)
        assert np.array_equal(y.copy_to_host(), y_ref, equal_nan=True)
        assert np.array_equal(idx.copy_to_host(), i_ref)
        dy = rng.standard_normal(y_ref.shape).astype(dt)
        dx = cuda.device_array(x.shape, dt)
        P.maxpool2d_backward(cuda.to_device(dy), idx, dx, k, s, pad)
        np.testing.assert_allclose(dx.copy_to_host(),
                                   P.maxpool2d_backward_ref(dy, i_ref, x.shape, k, s, pad),
                                   rtol=1e-6, atol=1e-6)
print("ok")
"""


def test_cuda_kernels_under_simulator():
    """The CUDA max-pool kernels (Numba CUDA simulator, small inputs, in a subprocess: the
    simulator must be on before numba.cuda is first imported)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "-c", CUDA_SIM_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
