"""Byte sizes: the pool's allocation unit, parsing ``"256MiB"``-style strings, formatting
byte counts for people."""

from __future__ import annotations

import numbers
import re
from fractions import Fraction

__all__ = ["ALLOCATION_UNIT", "UNITS", "aligned", "format_duration", "format_size", "parse_size",
           "readable_figures", "size_text"]

#: The default allocation unit of a :class:`~minidl.memory.runtime.pool.Pool`, in bytes: every
#: block's
#: offset and size are multiples of it, and the CPU arena's base is aligned to it. This is
#: its only definition. A pool may use another unit (``Pool(alignment=...)``): the engine
#: lowers each program for its pool's unit (``Program.alignment``), and every pass that rounds
#: a size rounds with the program's unit, so planned and dry-run peaks are exact for it.
ALLOCATION_UNIT = 512

#: Accepted units (case-insensitive) and their sizes in bytes.
UNITS: dict[str, int] = {
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def aligned(nbytes: int, unit: int = ALLOCATION_UNIT) -> int:
    """Bytes a block of ``nbytes`` occupies in a pool of allocation unit ``unit`` (at least
    one unit: a zero-byte request still takes a block)."""
    return max(unit, -(-int(nbytes) // unit) * unit)


_ACCEPTED = (
    "a positive whole number of bytes, given as an int or a string such as '1048576', "
    "'512B', '64KiB', '256MiB', '1.5GiB', '2 TiB' (binary units) or '500KB', '10MB', "
    "'1GB', '2TB' (decimal units); units are case-insensitive"
)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(s: int | str) -> int:
    """Return the number of bytes that ``s`` denotes; raise ``ValueError`` if it is not positive.

    ``s`` is an int (``1048576``) or a string with an optional unit among B, KiB, MiB, GiB, TiB
    (powers of 1024) and KB, MB, GB, TB (powers of 1000), e.g. ``"256MiB"``, ``"1.5 GiB"``.
    Decimal values are allowed when the result is a whole number of bytes.
    """
    if isinstance(s, bool):
        raise ValueError(f"invalid size {s!r}: expected {_ACCEPTED}")
    if isinstance(s, numbers.Integral):
        n = int(s)
    elif isinstance(s, str):
        m = _SIZE_RE.match(s)
        if m is None:
            if s.strip().startswith("-"):
                raise ValueError(f"invalid size {s!r}: sizes must be positive; "
                                 f"expected {_ACCEPTED}")
            raise ValueError(f"invalid size {s!r}: expected {_ACCEPTED}")
        number, unit = m.groups()
        mult = UNITS.get(unit.lower() or "b")
        if mult is None:
            raise ValueError(f"invalid size {s!r}: unknown unit {unit!r}; expected {_ACCEPTED}")
        exact = Fraction(number) * mult
        if exact.denominator != 1:
            raise ValueError(f"invalid size {s!r}: {exact} is not a whole number of bytes")
        n = int(exact)
    else:
        raise ValueError(f"invalid size {s!r} of type {type(s).__name__}: expected {_ACCEPTED}")
    if n <= 0:
        raise ValueError(f"invalid size {s!r}: sizes must be positive; expected {_ACCEPTED}")
    return n


_FORMAT_UNITS = (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30),
                 ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(n: int) -> str:
    """Human-readable binary size: ``"512 B"``, ``"1.50 GiB"`` (two decimals from 1 KiB up)."""
    n = int(n)
    a = abs(n)
    for name, unit in _FORMAT_UNITS:
        if a >= unit:
            return f"{n / unit:.2f} {name}"
    return f"{n} B"


_EXACT_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def size_text(n: int) -> str:
    """``n`` bytes written exactly as :func:`parse_size` reads it back, in the largest unit
    that divides it (binary first): ``17179869184`` -> ``"16GiB"``, ``1048576`` -> ``"1MiB"``,
    ``10**9`` -> ``"1GB"``; a count no unit divides stays in bytes (``"1000001"``)."""
    n = int(n)
    for name, unit in _EXACT_UNITS:
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def format_duration(seconds: float) -> str:
    """A time for people: milliseconds up to 10 s (``"640.07 ms"``), seconds above
    (``"64.07 s"``)."""
    s = float(seconds)
    if abs(s) > 10:
        return f"{s:,.2f} s"
    return f"{1e3 * s:.2f} ms"


#: A byte count written in bytes ("17,179,869,184 B"), not already the exact figure in
#: parentheses after a binary one ("16.00 GiB (17,179,869,184 B)").
_BYTES_RE = re.compile(r"(?<![\d,.(])(\d{1,3}(?:,\d{3})+|\d+) B\b")
#: A time in milliseconds ("64069.67 ms", "1,220,907.54 ms").
_MS_RE = re.compile(r"(?<![\d,.])(\d[\d,]*(?:\.\d+)?) ms\b")


def readable_figures(text: str) -> str:
    """``text`` (a note written for people) with its figures in the units a person would use:
    byte counts from 1 KiB up in binary units with the exact bytes after them
    (``"17,179,869,184 B"`` -> ``"16.00 GiB (17,179,869,184 B)"``), and times over 10 s in
    seconds (``"64069.67 ms"`` -> ``"64.07 s"``). Other text is left as it is."""
    def size(m: re.Match) -> str:
        n = int(m.group(1).replace(",", ""))
        return m.group(0) if n < 1024 else f"{format_size(n)} ({n:,} B)"

    def duration(m: re.Match) -> str:
        ms = float(m.group(1).replace(",", ""))
        return m.group(0) if ms <= 10_000 else format_duration(ms / 1e3)

    return _MS_RE.sub(duration, _BYTES_RE.sub(size, text))
