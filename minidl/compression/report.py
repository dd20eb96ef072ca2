"""What Deep Compression did, per layer and per stage: weights kept, bits per value and per
index, bytes before and after each stage, and the accuracy after each stage.

Stage sizes follow the paper's accounting (Han et al. 2016, Tables 2-5):

- dense: 32 bits per weight;
- pruned (P): each stored entry (non-zeros plus filler zeros) as a 32-bit value and a
  relative index of ``index_bits``;
- quantized (P+Q): each entry as a ``value_bits`` code and an index, plus the 32-bit codebook;
- Huffman (P+Q+H): the weight record actually written (streams, code tables, codebook, header).

Parameters that are not compressed (biases, BatchNorm) count 32 bits per value in every stage
(and their record's few header bytes in the last).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..kernels.compression import weight_record
from ..memory.ir.units import format_size
from .quantization import SharedWeights

STAGES = ("dense", "pruned", "quantized", "huffman")


@dataclass(frozen=True)
class LayerRow:
    """One parameter's line of the report."""

    param: str
    layer: str
    kind: str  # conv, fc, or "other" (stored as float32)
    weights: int
    kept: int
    entries: int  # stored entries: kept weights plus filler zeros
    value_bits: int
    index_bits: int
    codebook: int
    dense_bytes: int
    pruned_bytes: float
    quantized_bytes: float
    huffman_bytes: int
    value_bits_huffman: float  # mean bits per stored value after Huffman coding
    index_bits_huffman: float

    @property
    def kept_fraction(self) -> float:
        return self.kept / max(self.weights, 1)


def shared_row(param: str, layer: str, kind: str, shared: SharedWeights, index_bits: int,
               record: bytes) -> LayerRow:
    """The row of a pruned, weight-shared parameter."""
    info = weight_record.info(record)
    n = int(shared.codes.size)
    entries = info.entries
    k = len(shared.codebook)
    return LayerRow(
        param, layer, kind, n, shared.nonzeros, entries, shared.bits, index_bits, k,
        4 * n, entries * (32 + index_bits) / 8,
        entries * (shared.bits + index_bits) / 8 + 4 * k, len(record),
        8 * info.value_stream_bytes / max(entries, 1),
        8 * info.index_stream_bytes / max(entries, 1))


def raw_row(param: str, layer: str, values: Any, record: bytes) -> LayerRow:
    """The row of a parameter stored as it is (its own dtype, float32 for parameters)."""
    n = int(np.size(values))
    nbytes = int(np.asarray(values).nbytes)
    bits = 8 * nbytes // max(n, 1)
    return LayerRow(param, layer, "other", n, n, n, bits, 0, 0, nbytes, nbytes, nbytes,
                    len(record), float(bits), 0.0)


def totals(rows: list[LayerRow]) -> dict[str, float]:
    """Bytes of every stage, summed over the parameters."""
    return {"dense": sum(r.dense_bytes for r in rows),
            "pruned": sum(r.pruned_bytes for r in rows),
            "quantized": sum(r.quantized_bytes for r in rows),
            "huffman": sum(r.huffman_bytes for r in rows)}


def rows_as_dicts(rows: list[LayerRow]) -> list[dict[str, Any]]:
    return [asdict(r) | {"kept_fraction": r.kept_fraction} for r in rows]


def _size(n: float) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):,.2f} MiB"


def format_table(rows: list[LayerRow], accuracy: dict[str, float | None],
                 file_bytes: int) -> str:
    """The per-layer table and the per-stage summary, as text."""
    head = (f"{'layer':<14}{'weights':>10}{'kept':>8}{'bits':>6}{'idx':>5}{'H bits':>8}"
            f"{'H idx':>7}{'dense':>12}{'P':>12}{'P+Q':>12}{'P+Q+H':>12}{'ratio':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.kind == "other":
            continue
        lines.append(
            f"{r.param:<14.14}{r.weights:>10,}{100 * r.kept_fraction:>7.1f}%{r.value_bits:>6}"
            f"{r.index_bits:>5}{r.value_bits_huffman:>8.2f}{r.index_bits_huffman:>7.2f}"
            f"{_size(r.dense_bytes):>12}{_size(r.pruned_bytes):>12}"
            f"{_size(r.quantized_bytes):>12}{_size(r.huffman_bytes):>12}"
            f"{r.dense_bytes / max(r.huffman_bytes, 1):>7.1f}x")
    other = [r for r in rows if r.kind == "other"]
    if other:
        n = sum(r.weights for r in other)
        lines.append(f"{'(other)':<14}{n:>10,}{'100.0%':>8}{32:>6}{'':>5}{'':>8}{'':>7}"
                     f"{_size(4 * n):>12}{_size(4 * n):>12}{_size(4 * n):>12}"
                     f"{_size(sum(r.huffman_bytes for r in other)):>12}")
    t = totals(rows)
    kept = sum(r.kept for r in rows if r.kind != "other")
    weights = sum(r.weights for r in rows if r.kind != "other")
    lines.append("-" * len(head))
    lines.append(f"{'total':<14}{sum(r.weights for r in rows):>10,}"
                 f"{100 * kept / max(weights, 1):>7.1f}%{'':>26}{_size(t['dense']):>12}"
                 f"{_size(t['pruned']):>12}{_size(t['quantized']):>12}"
                 f"{_size(t['huffman']):>12}{t['dense'] / max(t['huffman'], 1):>7.1f}x")
    lines.append(f"compression: pruning {t['dense'] / t['pruned']:.1f}x, + quantization "
                 f"{t['dense'] / t['quantized']:.1f}x, + Huffman {t['dense'] / t['huffman']:.1f}x"
                 f"; the file ({format_size(file_bytes)}, header and checksum included) "
                 f"{t['dense'] / file_bytes:.1f}x")
    acc = [f"{k} {100 * v:.2f}%" for k, v in accuracy.items() if v is not None]
    if acc:
        lines.append("top-1 accuracy: " + ", ".join(acc))
    return "\n".join(lines)
