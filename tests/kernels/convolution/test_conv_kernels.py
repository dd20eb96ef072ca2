"""Conv kernels: Numba im2col / col2im and both CPU algorithms against the NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minidl.kernels.convolution import conv as K

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def conv_cases(draw, max_k: int = 3):
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, max_k)), draw(st.integers(1, max_k)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    hw = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    ho, wo = K.conv_output_hw(hw, kernel, stride, padding, dilation)
    assume(ho >= 1 and wo >= 1)
    n = draw(st.integers(1, 4))
    return dict(x_shape=(n, cin, *hw), cout=cout, kernel=kernel, stride=stride,
                padding=padding, dilation=dilation, groups=groups,
                bias=draw(st.booleans()), threads=None,
                seed=draw(st.integers(0, 2**31)))


def _run(case, dtype=np.float64, need_dx=True, workspace_pad=0, algo=None, cap=None):
    rng = np.random.default_rng(case["seed"])
    n, cin, h, w = case["x_shape"]
    cout, g = case["cout"], case["groups"]
    x = rng.standard_normal(case["x_shape"]).astype(dtype)
    wt = rng.standard_normal((cout, cin // g, *case["kernel"])).astype(dtype)
    b = rng.standard_normal(cout).astype(dtype) if case["bias"] else None
    geom = (case["stride"], case["padding"], case["dilation"], g)
    y_ref = K.conv2d_forward_ref(x, wt, b, *geom)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dx_ref, dw_ref, db_ref = K.conv2d_backward_ref(x, wt, dy, *geom)

    t = case["threads"]
    y = np.full(y_ref.shape, np.nan, dtype)
    nb = K.conv2d_workspace_bytes(x.shape, cout, case["kernel"], *geom, dtype, False, t, algo,
                                  cap)
    ws = np.full(nb + workspace_pad, 0xA5, np.uint8)
    K.conv2d_forward(x, wt, b, y, *geom, workspace=ws, threads=t, algo=algo, max_workspace=cap)
    dx = np.full(x.shape, np.nan, dtype) if need_dx else None
    dw = np.full(wt.shape, np.nan, dtype)
    db = np.full(cout, np.nan, dtype) if case["bias"] else None
    nb = K.conv2d_workspace_bytes(x.shape, cout, case["kernel"], *geom, dtype, True, t, algo,
                                  cap)
    ws = np.full(nb + workspace_pad, 0xA5, np.uint8)
    K.conv2d_backward(x, wt, dy, dx, dw, db, *geom, workspace=ws, threads=t, algo=algo,
                      max_workspace=cap)
    return (y, dx, dw, db), (y_ref, dx_ref, dw_ref, db_ref)


def _close(got, want, dtype):
    tol = 1e-10 if dtype == np.float64 else 2e-4
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, np.abs(b).max()))


@SETTINGS
@given(case=conv_cases(), need_dx=st.booleans())
def test_matches_reference(case, need_dx):
    got, want = _run(case, need_dx=need_dx)
    _close(got, want, np.float64)
    if not need_dx:
        assert got[1] is None


@pytest.mark.parametrize("algo", ["winograd", "winograd4"])
@SETTINGS
@given(case=conv_cases(), need_dx=st.booleans())
def test_winograd_matches_reference(algo, case, need_dx):
    case = dict(case, kernel=(3, 3), stride=(1, 1), dilation=(1, 1), groups=1,
                cout=case["cout"] // case["groups"])
    case["x_shape"] = (case["x_shape"][0], case["x_shape"][1] // case["groups"],
                       *case["x_shape"][2:])
    ho, wo = K.conv_output_hw(case["x_shape"][2:], (3, 3), (1, 1), case["padding"], (1, 1))
    assume(ho >= 1 and wo >= 1)
    got, want = _run(case, need_dx=need_dx, algo=algo)
    _close(got, want, np.float64)


def test_choose_algo():
    def algo(shape, cout=64, stride=(1, 1), groups=1):
        return K.choose_algo(shape, (3, 3), stride, (1, 1), groups, (1, 1), cout)

    assert algo((64, 32, 14, 14)) == "winograd"  # few channels: F(2x2)'s transforms win
    assert algo((64, 16, 32, 32), 16) == "winograd"
    assert algo((64, 64, 16, 16), 128) == "winograd4"
    assert algo((64, 8, 28, 28), 16) == "gemm"  # too few input channels
    assert algo((64, 1, 28, 28), 32) == "gemm"
    assert algo((64, 32, 14, 14), stride=(2, 2)) == "gemm"
    assert algo((64, 32, 14, 14), groups=2) == "gemm"
    assert algo((8, 128, 8, 8), 128) == "winograd4"
    assert algo((8, 128, 4, 4), 128) == "winograd4"  # one 4x4 tile
    assert algo((8, 128, 3, 3), 128) == "winograd4"  # one tile: 36 products for 9 outputs
    assert algo((8, 128, 2, 2), 128) == "winograd"  # F(4x4) would waste 3/4 of its tile
    assert algo((8, 128, 1, 1), 128) == "gemm"  # 9 products, where a 2x2 tile makes 16
    assert algo((8, 64, 40, 40)) == "winograd"
    assert algo((8, 64, 56, 56)) == "gemm"  # one image transformed by F(2x2): 9.6 MB > 8 MB
    assert algo((8, 128, 28, 28), 128) == "winograd4"
    assert algo((8, 256, 14, 14), 256) == "winograd4"
    assert algo((8, 512, 4, 4), 512) == "winograd4"
    assert algo((8, 512, 4, 4), 1024) == "gemm"  # transformed filters too big


def test_winograd_blocks_wide_products():
    """Small planes: images are blocked until the products have WINOGRAD_MIN_COLS columns,
    but the batch still makes GRAD_PARTS blocks; large planes keep the L2 rule."""
    from minidl.kernels.convolution.conv_geometry import GRAD_PARTS, WINOGRAD_MIN_COLS, _winograd_nb

    assert _winograd_nb((128, 256, 8, 8), 256, (1, 1), 4) * 16 == WINOGRAD_MIN_COLS
    assert _winograd_nb((128, 512, 4, 4), 512, (1, 1), 4) == 128 // GRAD_PARTS
    assert _winograd_nb((1, 512, 4, 4), 512, (1, 1), 4) == 1
    assert _winograd_nb((64, 16, 32, 32), 16, (1, 1), 4) >= 1


@pytest.mark.parametrize("algo", ["gemm", "winograd", "winograd4"])
def test_float32_and_threads(algo):
    case = dict(x_shape=(5, 4, 9, 7), cout=6, kernel=(3, 3), stride=(1, 1), padding=(1, 1),
                dilation=(1, 1), groups=1, bias=True, threads=2, seed=3)
    got, want = _run(case, np.float32, workspace_pad=100, algo=algo)
    assert all(a.dtype == np.float32 for a in got)
    _close(got, want, np.float32)
    for threads in (1, 3, 4):  # every output, bit for bit, whatever the thread count
        other, _ = _run(dict(case, threads=threads), np.float32, algo=algo)
        for a, b in zip(other, got):
            np.testing.assert_array_equal(a, b)
    again, _ = _run(case, np.float32, algo=algo)
    for a, b in zip(again, got):
        np.testing.assert_array_equal(a, b)  # deterministic


@SETTINGS
@given(case=conv_cases(), n=st.integers(1, 19), threads=st.integers(2, 5))
def test_bit_identical_across_thread_counts(case, n, threads):
    """Products and gradient sums have the same shapes and order for any thread count."""
    case = dict(case, x_shape=(n, *case["x_shape"][1:]))
    one, _ = _run(dict(case, threads=1), np.float32)
    many, _ = _run(dict(case, threads=threads), np.float32)
    for a, b in zip(one, many):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_gradient_parts_depend_on_shapes_only():
    assert K.grad_parts(64, 1) == K.GRAD_PARTS
    assert K.grad_parts(1, 1) == 1 and K.grad_parts(5, 4) == min(2, K.GRAD_PARTS)
    bounds = K.block_bounds(10, 3, 2)  # blocks 0:3 3:6 6:9 9:10, in two runs
    assert bounds.tolist() == [0, 6, 10]
    assert K.block_bounds(10, 3, 8).tolist() == [0, 3, 6, 9, 10]


def test_smallcnn_shapes_float32():
    for x_shape, cout in (((8, 1, 28, 28), 32), ((8, 32, 14, 14), 64)):
        case = dict(x_shape=x_shape, cout=cout, kernel=(3, 3), stride=(1, 1), padding=(1, 1),
                    dilation=(1, 1), groups=1, bias=True, threads=2, seed=0)
        got, want = _run(case, np.float32)
        _close(got, want, np.float32)


def test_workspace_too_small_raises_and_fewer_threads_fit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 18, 18))  # 256 output columns: one image per block
    w = rng.standard_normal((5, 3, 3, 3))
    y = np.empty((4, 5, 16, 16))
    one = K.conv2d_workspace_bytes(x.shape, 5, (3, 3), (1, 1), (0, 0), (1, 1), 1, x.dtype,
                                   False, threads=1)
    with pytest.raises(ValueError, match="workspace"):
        K.conv2d_forward(x, w, None, y, workspace=np.empty(one - 1, np.uint8), threads=2)
    K.conv2d_forward(x, w, None, y, workspace=np.empty(one, np.uint8), threads=2)
    np.testing.assert_allclose(y, K.conv2d_forward_ref(x, w, None), rtol=1e-12, atol=1e-12)
    two = K.conv2d_workspace_bytes(x.shape, 5, (3, 3), (1, 1), (0, 0), (1, 1), 1, x.dtype,
                                   False, threads=2)
    assert two == 2 * one


def test_non_contiguous_arrays():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 6, 5, 4)).transpose(0, 1, 3, 2)  # (3, 6, 4, 5), not C-order
    w = rng.standard_normal((4, 6, 2, 2))[:, :, ::-1]
    y = np.empty((3, 4, 4, 6, 2))[..., 0]  # (3, 4, 4, 6), strided output
    with pytest.raises(ValueError, match="y has shape"):
        K.conv2d_forward(x, w, None, y[:, :, :3], padding=(1, 1), dilation=(2, 1))
    K.conv2d_forward(x, w, None, y, padding=(1, 1), dilation=(2, 1))
    np.testing.assert_allclose(y, K.conv2d_forward_ref(x, w, None, (1, 1), (1, 1), (2, 1)),
                               rtol=1e-12, atol=1e-12)
    dy = rng.standard_normal((3, 4, 4, 6))
    dx, dw = np.empty((3, 6, 4, 5, 2))[..., 1], np.empty((4, 6, 2, 2, 2))[..., 0]
    K.conv2d_backward(x, w, dy, dx, dw, None, padding=(1, 1), dilation=(2, 1))
    dx_r, dw_r, _ = K.conv2d_backward_ref(x, w, dy, (1, 1), (1, 1), (2, 1))
    np.testing.assert_allclose(dx, dx_r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dw_r, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(c=st.integers(1, 3), h=st.integers(1, 7), w=st.integers(1, 7), kh=st.integers(1, 3),
       kw=st.integers(1, 3), sh=st.integers(1, 3), sw=st.integers(1, 3), ph=st.integers(0, 2),
       pw=st.integers(0, 2), dh=st.integers(1, 2), dw=st.integers(1, 2))
def test_im2col_col2im_match_reference(c, h, w, kh, kw, sh, sw, ph, pw, dh, dw):
    ho, wo = K.conv_output_hw((h, w), (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    assume(ho >= 1 and wo >= 1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, c, h, w))
    rows, hwo = c * kh * kw, ho * wo
    ld, coff = 2 * hwo + 3, hwo + 1  # an image's block inside a wider matrix
    col = np.full(rows * ld, np.nan)
    K.im2col(x.reshape(-1), c * h * w, col, ld, coff, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw,
             ho, wo, 0, ho)
    want = K.im2col_ref(x[1], (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    block = col.reshape(rows, ld)
    np.testing.assert_array_equal(block[:, coff: coff + hwo], want)
    assert np.isnan(block[:, :coff]).all() and np.isnan(block[:, coff + hwo:]).all()
    # col2im is the adjoint of im2col: <im2col(x), c> == <x, col2im(c)>
    cvec = rng.standard_normal(col.size)
    dx = np.zeros(2 * c * h * w)
    K.col2im(cvec, ld, coff, dx, c * h * w, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo,
             0, ho)
    got = np.dot(want.reshape(-1), cvec.reshape(rows, ld)[:, coff: coff + hwo].reshape(-1))
    np.testing.assert_allclose(got, np.dot(x[1].reshape(-1), dx[c * h * w:]), rtol=1e-10,
                               atol=1e-10)


def test_column_pitch_wide_only_for_short_unpadded_stride_one_rows():
    from minidl.kernels.convolution.conv_geometry import column_pitch
    one = (1, 1)
    assert column_pitch((14, 14), (5, 5), one, (0, 0), one) == 14  # LeNet-5 conv2: 10 of 14
    assert column_pitch((8, 8), (3, 3), one, (0, 0), one) == 8
    assert column_pitch((14, 14), (5, 5), one, (1, 1), one) == 12  # padded: plain
    assert column_pitch((14, 14), (5, 5), (2, 2), (0, 0), one) == 5  # strided: plain
    assert column_pitch((32, 32), (3, 3), one, (0, 0), one) == 30  # long rows: plain
    assert column_pitch((14, 14), (7, 7), one, (0, 0), one) == 8  # 66 % unused: plain
    assert column_pitch((14, 14), (1, 1), one, (0, 0), one) == 14  # as wide as the input


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 7), groups=st.integers(1, 2), cin=st.integers(1, 3),
       cout=st.integers(1, 3), kh=st.integers(2, 4), kw=st.integers(2, 4),
       h=st.integers(4, 10), extra_w=st.integers(0, 6), dh=st.integers(1, 2),
       dw=st.integers(1, 2), bias=st.booleans(), need_dx=st.booleans(),
       threads=st.sampled_from([None, 1, 3]), dtype=st.sampled_from([np.float64, np.float32]))
def test_wide_layout_matches_reference(n, groups, cin, cout, kh, kw, h, extra_w, dh, dw, bias,
                                       need_dx, threads, dtype):
    """Unpadded stride-1 layers whose output rows are short take the wide im2col layout (its
    unused columns never reach the outputs or the gradients), blocks of several images and
    of one, any thread count, NaN-filled outputs and a workspace of stray bytes."""
    from minidl.kernels.convolution.conv_geometry import column_pitch
    w = (kw - 1) * dw + 1 + extra_w
    ho, wo = K.conv_output_hw((h, w), (kh, kw), (1, 1), (0, 0), (dh, dw))
    assume(ho >= 1 and column_pitch((h, w), (kh, kw), (1, 1), (0, 0), (dh, dw)) == w != wo)
    case = dict(x_shape=(n, groups * cin, h, w), cout=groups * cout, kernel=(kh, kw),
                stride=(1, 1), padding=(0, 0), dilation=(dh, dw), groups=groups, bias=bias,
                threads=threads, seed=n * 7 + h)
    got, want = _run(case, dtype, need_dx=need_dx, workspace_pad=5, algo="gemm")
    _close(got, want, dtype)


@pytest.mark.parametrize("cap", [0, 700, 5000])
def test_banded_and_blocked_gemm(cap):
    """Small workspace caps: large planes in bands of output rows (one row at the least),
    small ones several images per product; float64 and the threaded float32 path."""
    for dtype, threads in ((np.float64, None), (np.float32, 2)):
        case = dict(x_shape=(5, 4, 9, 7), cout=6, kernel=(3, 2), stride=(2, 1), padding=(1, 1),
                    dilation=(1, 2), groups=2, bias=True, threads=threads, seed=5)
        cfg = K.conv_config(case["x_shape"], 6, (3, 2), (2, 1), (1, 1), (1, 2), 2,
                            np.dtype(dtype).itemsize, True, cap, "gemm")
        assert cfg.col_bytes < K.GEMM_MAX_COL_BYTES  # banded or fewer images per product
        got, want = _run(case, dtype, algo="gemm", cap=cap)
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blas_mm_strided_and_transposed(dtype):
    from minidl.kernels.blas import mm

    rng = np.random.default_rng(0)
    work = np.zeros(8, np.int32)
    for ta in (False, True):
        for tb in (False, True):
            m, n, k = 5, 7, 3
            a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
            b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
            big = rng.standard_normal((m + 2, n + 4)).astype(dtype)
            c = big[1: 1 + m, 2: 2 + n]  # a strided view: rows of n inside rows of n + 4
            want = 2.0 * ((a.T if ta else a) @ (b.T if tb else b)) + 0.5 * c
            keep = big.copy()
            mm(a, b, c, ta, tb, 2.0, 0.5, m, n, k, work)
            np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5)
            keep[1: 1 + m, 2: 2 + n] = c
            np.testing.assert_array_equal(big, keep)  # nothing outside the view written


@pytest.mark.parametrize("algo", ["gemm", "winograd", "winograd4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_accumulates_into_gradients(algo, threads):
    """``accumulate=True`` adds dW and db to what the arrays hold (micro-batches)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 4, 9, 7))
    w = rng.standard_normal((5, 4, 3, 3))
    dy = rng.standard_normal((6, 5, 9, 7))
    _, dw_ref, db_ref = K.conv2d_backward_ref(x, w, dy, padding=(1, 1))
    dw0, db0 = rng.standard_normal(w.shape), rng.standard_normal(5)
    dw = np.asfortranarray(dw0)  # a non-contiguous gradient takes the copy-back path
    db = db0.copy()
    dx = np.empty_like(x)
    K.conv2d_backward(x, w, dy, dx, dw, db, padding=(1, 1), threads=threads, algo=algo,
                      accumulate=True)
    np.testing.assert_allclose(dw, dw0 + dw_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(db, db0 + db_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("algo,bound", [("winograd", 4e-6), ("winograd4", 5e-5)])
def test_winograd_float32_rounding_within_the_stated_bound(algo, bound):
    """float32 Winograd against the float64 convolution, relative to the largest magnitude
    of each result: here F(2x2) measured <= 4.1e-7 (im2col 5.2e-7), F(4x4) <= 5.5e-6 (its
    transforms' coefficients reach 8 and 1/24; ~1.5e-5 at 256 channels); bounds 10x that."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 128, 8, 8))
    w = rng.standard_normal((128, 128, 3, 3)) / 34.0
    b = rng.standard_normal(128)
    y_ref = K.conv2d_forward_ref(x, w, b, padding=(1, 1))
    dy = rng.standard_normal(y_ref.shape)
    refs = (y_ref, *K.conv2d_backward_ref(x, w, dy, padding=(1, 1)))
    f = np.float32
    y = np.empty(y_ref.shape, f)
    K.conv2d_forward(x.astype(f), w.astype(f), b.astype(f), y, padding=(1, 1), algo=algo)
    dx, dw, db = np.empty(x.shape, f), np.empty(w.shape, f), np.empty(128, f)
    K.conv2d_backward(x.astype(f), w.astype(f), dy.astype(f), dx, dw, db, padding=(1, 1),
                      algo=algo)
    for got, want in zip((y, dx, dw, db), refs):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= bound, (algo, err)


def test_host_call_made_once_per_shapes_and_left_unchanged():
    """The per-call setup is cached by shapes, workspace size and threads; the kernels never
    write its shared arrays."""
    from minidl.kernels.convolution.conv_geometry import host_call
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    y, dy = np.empty((6, 4, 9, 9), np.float32), rng.standard_normal((6, 4, 9, 9)).astype(
        np.float32)
    key = ((6, 3, 9, 9), 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, 4, True, None, "gemm", 2, 16,
           None, K.SERIAL_MACS)
    call = host_call(*key)
    assert host_call(*key) is call
    offs, bounds = call.offs.copy(), call.bounds.copy()
    for _ in range(2):
        K.conv2d_forward(x, w, None, y, padding=(1, 1), threads=2, algo="gemm")
        K.conv2d_backward(x, w, dy, np.empty_like(x), np.empty_like(w), None, padding=(1, 1),
                          threads=2, algo="gemm")
    np.testing.assert_array_equal(call.offs, offs)
    np.testing.assert_array_equal(call.bounds, bounds)
    smaller = host_call(*key[:-2], call.nbytes - call.row_elems * 4, K.SERIAL_MACS)
    assert smaller.rows == call.rows - 1 >= 1
