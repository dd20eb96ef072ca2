"""parse_size / format_size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidl.memory import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1, 1),
        (1048576, 1048576),
        (np.int64(4096), 4096),
        ("4096", 4096),
        ("512B", 512),
        ("512 b", 512),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("256MiB", 256 << 20),
        ("256 MIB", 256 << 20),
        ("1GiB", 1 << 30),
        ("1.5GiB", 3 << 29),
        ("2 TiB", 2 << 40),
        ("500KB", 500_000),
        ("10MB", 10_000_000),
        ("1gb", 10**9),
        ("2TB", 2 * 10**12),
        ("0.5KiB", 512),
        (" 3.0 MiB ", 3 << 20),
        ("2.", 2),
        (".5KiB", 512),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad",
    ["", "abc", "12XB", "1.5", "0.3B", "1e9", "-5", "-1MiB", "0", "0MiB", 0, -1, True, 1.5,
     None, "1 0MiB", "MiB"],
)
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError) as e:
        parse_size(bad)
    msg = str(e.value)
    assert "invalid size" in msg
    if bad not in ("1.5", "0.3B"):
        assert "MiB" in msg and "GB" in msg  # the accepted forms are listed


def test_parse_size_fraction_message():
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size("1.5")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (512, "512 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 << 29, "1.50 GiB"),
     (256 << 20, "256.00 MiB"), (5 << 40, "5.00 TiB"), (1 << 62, "4.00 EiB"), (-2048, "-2.00 KiB")],
)
def test_format_size(n, text):
    assert format_size(n) == text


@given(st.integers(min_value=1, max_value=1 << 50))
def test_format_then_parse_is_close(n):
    value, unit = format_size(n).split()
    back = float(value) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30,
                           "TiB": 1 << 40, "PiB": 1 << 50}[unit]
    assert abs(back - n) <= 0.005 * n + 1
