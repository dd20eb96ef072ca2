"""What the pool reports: the block categories its stats are kept by, and the readable
summary table of :meth:`Pool.memory_summary <minidl.memory.runtime.pool.Pool.memory_summary>`."""

from __future__ import annotations

from typing import Any

from ..ir.names import Category
from ..ir.units import format_size

__all__ = ["CATEGORIES", "format_memory_summary"]

#: What a block holds; every allocation names one (stats are kept per category).
CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)


def format_memory_summary(s: dict[str, Any], device_name: str, policy: str) -> str:
    """The stats ``s`` of :meth:`Pool.stats` as a table: current and peak bytes by category."""
    width = 74

    def row(name: str, cur: str, peak: str) -> str:
        return f"| {name:<30} | {cur:>18} | {peak:>18} |"

    def both(key: str) -> tuple[str, str]:
        return format_size(s[f"{key}.current"]), format_size(s[f"{key}.peak"])

    cap = s["capacity"]
    cap_txt = "unlimited" if cap >= 1 << 62 else format_size(cap)
    head = f"device {device_name}, capacity {cap_txt}, policy {policy}"
    lines = [
        "=" * width,
        f"| {'minidl pool memory summary':^{width - 4}} |",
        f"| {head:<{width - 4}} |",
        "-" * width,
        row("metric", "current", "peak"),
        "-" * width,
        row("allocated", *both("allocated_bytes")),
        row("reserved (span of live blocks)", *both("reserved_bytes")),
    ]
    for c in CATEGORIES:
        lines.append(row(f"  {c}", *both(f"allocated_bytes.{c}")))
    lines += [
        "-" * width,
        row("free bytes", format_size(s["free_bytes"]), ""),
        row("largest free block", format_size(s["largest_free_block"]), ""),
        row("fragmentation", f"{s['fragmentation']:.3f}", ""),
        row("active blocks", str(s["active_blocks"]), ""),
        row("allocs / frees / ooms",
            f"{s['num_allocs']} / {s['num_frees']} / {s['num_ooms']}", ""),
        "=" * width,
    ]
    return "\n".join(lines)
