"""Sizes the pool tests share: KiB and the pool's rounding to its allocation unit."""

from __future__ import annotations

KiB = 1024


def rounded(n: int, a: int = 512) -> int:
    """``n`` bytes rounded up to the unit ``a`` (at least one unit)."""
    return max(a, -(-n // a) * a)
