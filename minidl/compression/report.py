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

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.compression import weight_record
from ..memory.ir.units import format_size
from .quantization import SharedWeights

STAGES = ("dense", "pruned", "quantized", "huffman")


@dataclass(frozen=True)
class WeightCounts:
    """How many values a parameter holds and stores."""

    weights: int
    kept: int
    entries: int  # stored entries: kept weights plus filler zeros
    codebook: int  # shared values (0 for a parameter stored as it is)


@dataclass(frozen=True)
class BitWidths:
    """Bits per stored value and per relative index: as coded, and the mean after Huffman."""

    value: int
    index: int
    value_huffman: float
    index_huffman: float


@dataclass(frozen=True)
class StageBytes:
    """A parameter's bytes after each stage (:data:`STAGES`)."""

    dense: int
    pruned: float
    quantized: float
    huffman: int


@dataclass(frozen=True)
class LayerRow:
    """One parameter's line of the report."""

    param: str
    layer: str
    kind: str  # conv, fc, or "other" (stored as float32)
    counts: WeightCounts
    bits: BitWidths
    sizes: StageBytes

    @property
    def kept_fraction(self) -> float:
        return self.counts.kept / max(self.counts.weights, 1)

    def as_dict(self) -> dict[str, Any]:
        """The row as the flat record of the JSON report (its keys in their order)."""
        c, b, s = self.counts, self.bits, self.sizes
        return {"param": self.param, "layer": self.layer, "kind": self.kind,
                "weights": c.weights, "kept": c.kept, "entries": c.entries,
                "value_bits": b.value, "index_bits": b.index, "codebook": c.codebook,
                "dense_bytes": s.dense, "pruned_bytes": s.pruned,
                "quantized_bytes": s.quantized, "huffman_bytes": s.huffman,
                "value_bits_huffman": b.value_huffman, "index_bits_huffman": b.index_huffman,
                "kept_fraction": self.kept_fraction}


def shared_row(param: str, layer: str, kind: str, shared: SharedWeights, index_bits: int,
               record: bytes) -> LayerRow:
    """The row of a pruned, weight-shared parameter."""
    info = weight_record.info(record)
    n = int(shared.codes.size)
    entries = info.entries
    k = len(shared.codebook)
    return LayerRow(
        param, layer, kind, WeightCounts(n, shared.nonzeros, entries, k),
        BitWidths(shared.bits, index_bits, 8 * info.value_stream_bytes / max(entries, 1),
                  8 * info.index_stream_bytes / max(entries, 1)),
        StageBytes(4 * n, entries * (32 + index_bits) / 8,
                   entries * (shared.bits + index_bits) / 8 + 4 * k, len(record)))


def raw_row(param: str, layer: str, values: Any, record: bytes) -> LayerRow:
    """The row of a parameter stored as it is (its own dtype, float32 for parameters)."""
    n = int(np.size(values))
    nbytes = int(np.asarray(values).nbytes)
    bits = 8 * nbytes // max(n, 1)
    return LayerRow(param, layer, "other", WeightCounts(n, n, n, 0),
                    BitWidths(bits, 0, float(bits), 0.0),
                    StageBytes(nbytes, nbytes, nbytes, len(record)))


def totals(rows: list[LayerRow]) -> dict[str, float]:
    """Bytes of every stage, summed over the parameters."""
    return {stage: sum(getattr(r.sizes, stage) for r in rows) for stage in STAGES}


def rows_as_dicts(rows: list[LayerRow]) -> list[dict[str, Any]]:
    return [r.as_dict() for r in rows]


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
            f"{r.param:<14.14}{r.counts.weights:>10,}{100 * r.kept_fraction:>7.1f}%"
            f"{r.bits.value:>6}{r.bits.index:>5}{r.bits.value_huffman:>8.2f}"
            f"{r.bits.index_huffman:>7.2f}{_size(r.sizes.dense):>12}{_size(r.sizes.pruned):>12}"
            f"{_size(r.sizes.quantized):>12}{_size(r.sizes.huffman):>12}"
            f"{r.sizes.dense / max(r.sizes.huffman, 1):>7.1f}x")
    other = [r for r in rows if r.kind == "other"]
    if other:
        n = sum(r.counts.weights for r in other)
        lines.append(f"{'(other)':<14}{n:>10,}{'100.0%':>8}{32:>6}{'':>5}{'':>8}{'':>7}"
                     f"{_size(4 * n):>12}{_size(4 * n):>12}{_size(4 * n):>12}"
                     f"{_size(sum(r.sizes.huffman for r in other)):>12}")
    t = totals(rows)
    kept = sum(r.counts.kept for r in rows if r.kind != "other")
    weights = sum(r.counts.weights for r in rows if r.kind != "other")
    lines.append("-" * len(head))
    lines.append(f"{'total':<14}{sum(r.counts.weights for r in rows):>10,}"
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
