"""Convolution under a workspace cap (``max_workspace``): the configuration it picks, the
workspace it declares (and runs in, exactly), results equal to the default algorithm's within
float32 rounding and bit-identical across thread counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minidl.kernels.convolution import conv as K
from minidl.kernels.convolution import conv_device as D
from minidl.kernels.convolution.conv_geometry import REFERENCE_ROWS

GEOM = dict(kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
CANARY = 0xA5


def _ws_bytes(x_shape, cout, backward, cap, threads=None, geom=GEOM, dtype=np.float32):
    return K.conv2d_workspace_bytes(x_shape, cout, geom["kernel"], geom["stride"],
                                    geom["padding"], geom["dilation"], geom["groups"], dtype,
                                    backward, threads, max_workspace=cap)


def _config(x_shape, cout, backward, cap, geom=GEOM):
    return K.conv_config(x_shape, cout, geom["kernel"], geom["stride"], geom["padding"],
                         geom["dilation"], geom["groups"], 4, backward, cap)


def _run(x, w, b, dy, cap, threads, geom=GEOM):
    """Forward and backward in workspaces of exactly the declared size, each followed by
    canary bytes that must stay untouched."""
    g = (geom["stride"], geom["padding"], geom["dilation"], geom["groups"])
    cout = w.shape[0]
    out = []
    for backward in (False, True):
        n = _ws_bytes(x.shape, cout, backward, cap, threads, geom, x.dtype)
        buf = np.full(n + 64, CANARY, np.uint8)
        ws = buf[:n]
        if not backward:
            y = np.full(dy.shape, np.nan, x.dtype)
            K.conv2d_forward(x, w, b, y, *g, workspace=ws, threads=threads, max_workspace=cap)
            out.append(y)
        else:
            dx, dw = np.full(x.shape, np.nan, x.dtype), np.full(w.shape, np.nan, x.dtype)
            db = np.full(cout, np.nan, x.dtype)
            K.conv2d_backward(x, w, dy, dx, dw, db, *g, workspace=ws, threads=threads,
                              max_workspace=cap)
            out += [dx, dw, db]
        assert (buf[n:] == CANARY).all(), "wrote past the declared workspace"
    return out


def _data(x_shape, cout, geom=GEOM, seed=0):
    rng = np.random.default_rng(seed)
    cin = x_shape[1]
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((cout, cin // geom["groups"], *geom["kernel"])).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    ho, wo = K.conv_output_hw(x_shape[2:], geom["kernel"], geom["stride"], geom["padding"],
                              geom["dilation"])
    dy = rng.standard_normal((x_shape[0], cout, ho, wo)).astype(np.float32)
    return x, w, b, dy


def _close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4 * max(1.0, np.abs(b).max()))


# A Winograd layer, a banded im2col layer with a large weight partial, a small-plane layer
# whose products put several images side by side, and a strided grouped one.
SHAPES = [
    ((6, 32, 16, 16), 32, GEOM),
    ((3, 64, 24, 24), 96, GEOM),
    ((9, 48, 3, 3), 64, GEOM),
    ((5, 8, 11, 9), 12, dict(kernel=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
                             groups=2)),
]


def test_no_cap_or_a_large_one_is_the_default():
    for x_shape, cout, geom in SHAPES:
        for backward in (False, True):
            default = _config(x_shape, cout, backward, None, geom)
            assert default == K.ConvConfig(K.choose_algo(
                x_shape, geom["kernel"], geom["stride"], geom["dilation"], geom["groups"],
                geom["padding"], cout))
            full = _ws_bytes(x_shape, cout, backward, None, REFERENCE_ROWS, geom)
            assert _config(x_shape, cout, backward, full, geom) == default
            assert _ws_bytes(x_shape, cout, backward, 10 * full, REFERENCE_ROWS, geom) == \
                _ws_bytes(x_shape, cout, backward, None, REFERENCE_ROWS, geom)
            # a cap declares rows for REFERENCE_ROWS threads, whatever the machine has
            assert _ws_bytes(x_shape, cout, backward, 10 * full, None, geom) == \
                _ws_bytes(x_shape, cout, backward, 10 * full, REFERENCE_ROWS, geom)
    assert _config((6, 32, 16, 16), 32, True, None).algo == "winograd"
    assert _config((6, 128, 16, 16), 128, True, None).algo == "winograd4"


def test_a_cap_below_winograd4_falls_back_to_winograd_then_gemm():
    """F(4x4)'s 36 transformed planes need more workspace than F(2x2)'s 16: a cap between
    the two runs F(2x2); a cap below both, im2col."""
    x_shape, cout = (64, 256, 4, 4), 256
    f4 = K.conv2d_workspace_bytes(x_shape, cout, (3, 3), (1, 1), (1, 1), (1, 1), 1,
                                  np.float32, True, REFERENCE_ROWS, "winograd4")
    f2 = K.conv2d_workspace_bytes(x_shape, cout, (3, 3), (1, 1), (1, 1), (1, 1), 1,
                                  np.float32, True, REFERENCE_ROWS, "winograd")
    assert f2 < f4
    assert _config(x_shape, cout, True, f4).algo == "winograd4"
    assert _config(x_shape, cout, True, f2).algo == "winograd"
    assert _config(x_shape, cout, True, f2 // 4).algo == "gemm"


def test_workspace_stays_within_the_cap_and_falls_with_it():
    for x_shape, cout, geom in SHAPES:
        for backward in (False, True):
            least = _ws_bytes(x_shape, cout, backward, 0, 1, geom)
            full = _ws_bytes(x_shape, cout, backward, None, None, geom)
            assert least < full
            last = full
            for cap in sorted({full, full // 2, full // 3, full // 5, full // 9, least}
                              | {least + (full - least) * k // 7 for k in range(7)},
                              reverse=True):
                got = _ws_bytes(x_shape, cout, backward, cap, None, geom)
                assert got <= max(cap, least) and got <= last
                last = got
            assert _ws_bytes(x_shape, cout, backward, 0, None, geom) == least  # at the floor


def test_the_lean_backward_of_a_wide_layer_drops_the_weight_partial():
    # 512 x 512 channels, 3x3: the default backward keeps a 9.4 MB weight-gradient partial
    # and two rows of column matrices; the least workspace is one band of one image.
    x_shape = (64, 512, 28, 28)
    full = _ws_bytes(x_shape, 512, True, None, 2)
    least = _ws_bytes(x_shape, 512, True, 0, 2)
    assert full > 24 << 20 and least < 1 << 20
    cfg = _config(x_shape, 512, True, 0)
    assert cfg.algo == "gemm" and cfg.parts == 1
    assert _config(x_shape, 512, True, 16 << 20).parts == 2  # the partial and two rows fit
    assert _config(x_shape, 512, True, 8 << 20).parts == 1  # a 9.4 MB partial: too big


@pytest.mark.parametrize("case", range(len(SHAPES)))
def test_results_match_the_default_and_are_bit_identical_across_threads(case):
    x_shape, cout, geom = SHAPES[case]
    x, w, b, dy = _data(x_shape, cout, geom, seed=case)
    default = _run(x, w, b, dy, None, 2, geom)
    g = (geom["stride"], geom["padding"], geom["dilation"], geom["groups"])
    _close(default[:1], [K.conv2d_forward_ref(x.astype(np.float64), w.astype(np.float64),
                                              b.astype(np.float64), *g)])
    full = _ws_bytes(x_shape, cout, True, None, 2, geom)
    configs = set()
    for cap in (full, full // 2, full // 4, full // 16, 0):
        one = _run(x, w, b, dy, cap, 1, geom)
        _close(one, default)  # another summation order: equal to float32 rounding
        for threads in (2, 3):
            for a, c in zip(_run(x, w, b, dy, cap, threads, geom), one):
                np.testing.assert_array_equal(a, c)  # same cap, any thread count: same bits
        configs.add(_config(x_shape, cout, True, cap, geom))
    assert len(configs) > 1  # the caps did change the configuration


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), cin=st.integers(1, 20), cout=st.integers(1, 20),
       hw=st.integers(1, 12), k=st.sampled_from([1, 3]), frac=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**31))
def test_random_caps_fit_and_agree(n, cin, cout, hw, k, frac, seed):
    geom = dict(GEOM, kernel=(k, k), padding=(k // 2, k // 2))
    x_shape = (n, cin, hw, hw)
    ho, _ = K.conv_output_hw((hw, hw), (k, k), (1, 1), geom["padding"], (1, 1))
    assume(ho >= 1)
    x, w, b, dy = _data(x_shape, cout, geom, seed)
    full = _ws_bytes(x_shape, cout, True, None, 2, geom)
    cap = int(frac * full)
    default = _run(x, w, b, dy, None, 1, geom)
    one = _run(x, w, b, dy, cap, 1, geom)
    _close(one, default)
    for a, c in zip(_run(x, w, b, dy, cap, 2, geom), one):
        np.testing.assert_array_equal(a, c)


def test_a_workspace_too_small_for_the_cap_raises():
    x, w, b, dy = _data((2, 16, 10, 10), 16)
    n = _ws_bytes(x.shape, 16, True, 0, 1)
    with pytest.raises(ValueError, match="workspace"):
        K.conv2d_backward(x, w, dy, np.empty_like(x), np.empty_like(w), None,
                          padding=(1, 1), workspace=np.empty(n - 64, np.uint8),
                          max_workspace=0)


def test_device_path_tiles_within_the_cap():
    """The device path (on NumPy arrays) under a cap: smaller tiles, within the cap, exactly
    sized workspaces, the same results to rounding."""
    x_shape, cout = (12, 16, 20, 20), 24
    x, w, b, dy = _data(x_shape, cout)
    geom = ((3, 3), (1, 1), (1, 1), (1, 1), 1)
    g = ((1, 1), (1, 1), (1, 1), 1)
    ref = _run(x, w, b, dy, None, 1)
    for backward in (False, True):
        full = D.conv2d_device_workspace_bytes(x_shape, cout, *geom, np.float32, backward)
        least = D.conv2d_device_workspace_bytes(x_shape, cout, *geom, np.float32, backward, 0)
        assert least < full
        assert D.device_layout(x_shape, cout, *geom, 4, backward, 0).rows == 1
        for cap in (full, full // 3, full // 10, 0):
            n = D.conv2d_device_workspace_bytes(x_shape, cout, *geom, np.float32, backward, cap)
            assert n <= max(cap, least)
            buf = np.full(n + 256, CANARY, np.uint8)
            if not backward:
                y = np.empty(dy.shape, np.float32)
                D.conv2d_forward_device(x, w, b, y, *g, buf[:n], max_workspace=cap)
                _close([y], ref[:1])
            else:
                dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty(cout, np.float32)
                D.conv2d_backward_device(x, w, dy, dx, dw, db, *g, buf[:n], max_workspace=cap)
                _close([dx, dw, db], ref[1:])
            assert (buf[n:] == CANARY).all()


def test_a_cap_can_keep_winograd_with_smaller_blocks():
    """Between the full Winograd workspace and one image per block, a cap picks Winograd
    with fewer images per block (its transformed tiles under WINOGRAD_LEAN_FACTOR times the
    column cap), which runs within the declared workspace and matches the default."""
    from minidl.kernels.convolution.conv_geometry import GEMM_MAX_COL_BYTES

    x_shape, cout = (32, 128, 8, 8), 128
    full = _ws_bytes(x_shape, cout, True, None, REFERENCE_ROWS)
    picked = None
    for k in range(1, 40):
        cap = full * (40 - k) // 40
        cfg = _config(x_shape, cout, True, cap)
        if cfg.algo.startswith("winograd") and 0 < cfg.col_bytes < GEMM_MAX_COL_BYTES:
            picked = cap
            break
    assert picked is not None, "no cap kept Winograd with smaller blocks"
    lean = K.conv_config(x_shape, cout, (3, 3), (1, 1), (1, 1), (1, 1), 1, 4, True, picked)
    assert _ws_bytes(x_shape, cout, True, picked) <= picked
    x, w, b, dy = _data(x_shape, cout)
    default = _run(x, w, b, dy, None, 2)
    one = _run(x, w, b, dy, picked, 1)
    _close(one, default)
    for a, c in zip(_run(x, w, b, dy, picked, 2), one):
        np.testing.assert_array_equal(a, c)
    assert lean.algo.startswith("winograd")
