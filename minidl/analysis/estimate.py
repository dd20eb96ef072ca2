"""The estimate table of ``minidl plan --ranks 1,2,8 --table``: one row per ZeRO stage and rank
count with what one rank holds at its peak (parameters, gradients, optimizer state, activations,
workspace), its peak and the largest batch per rank that fits a budget. As ``accelerate
estimate-memory`` and DeepSpeed's ``estimate_zero3_model_states_mem_needs`` give, but exact (a
dry run per row, the plan a real run gets) and with the activations, which neither counts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..memory.ir.config import MemoryConfig
from ..memory.ir.units import format_size
from ..net.graph import Network
from .dryrun import dry_run

#: Breakdown categories shown as their own columns; every other one counts as activations.
MODEL_STATE = ("parameter", "gradient", "optimizer_state")
#: The categories of the workspace column.
WORKSPACE = ("workspace",)
#: The largest batch per rank the search tries.
MAX_BATCH_LIMIT = 1 << 14


@dataclass(frozen=True)
class HeldBytes:
    """What one rank holds at its iteration's peak, in bytes, by column of the table."""

    parameter: int
    gradient: int
    optimizer_state: int
    activations: int
    workspace: int


@dataclass(frozen=True)
class EstimateRow:
    """One rank's memory under ZeRO ``stage`` over ``ranks`` ranks, at ``batch_per_rank``
    samples (the global batch's shard): the bytes it holds at the iteration's peak by column
    (``held``) and its peaks; ``max_batch_per_rank``: the largest shard whose peak reserved
    fits the budget (``None`` without a budget); ``host``: the state it keeps on its host
    (``offload``: its owned ranges' under ZeRO)."""

    stage: int
    ranks: int
    batch_per_rank: int
    held: HeldBytes
    peak_allocated: int
    peak_reserved: int
    max_batch_per_rank: int | None = None
    host: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The row as one flat record (the JSON of ``minidl plan --table --json``)."""
        return {"stage": self.stage, "ranks": self.ranks, "batch_per_rank": self.batch_per_rank,
                **asdict(self.held), "peak_allocated": self.peak_allocated,
                "peak_reserved": self.peak_reserved,
                "max_batch_per_rank": self.max_batch_per_rank, "host": self.host}


def _spec_with_stage(memory: str | MemoryConfig, stage: int) -> MemoryConfig | None:
    """``memory`` at ZeRO ``stage``; ``None`` where the spec cannot be combined with it
    (offload with zero=3)."""
    flags = {k: v for k, v in MemoryConfig.parse(memory).flags.items() if k != "zero"}
    if stage:
        flags["zero"] = str(stage)
    config = MemoryConfig(flags)
    try:
        MemoryConfig.parse(config.spec)
    except ValueError:
        return None
    return config


def _row(report: dict[str, Any], stage: int, ranks: int) -> EstimateRow:
    by = report["breakdown"]
    state = {cat: by.get(cat, 0) for cat in MODEL_STATE}
    workspace = sum(by.get(cat, 0) for cat in WORKSPACE)
    activations = sum(v for k, v in by.items() if k not in MODEL_STATE and k not in WORKSPACE)
    held = HeldBytes(state["parameter"], state["gradient"], state["optimizer_state"],
                     activations, workspace)
    return EstimateRow(stage, ranks, report["batch_size"], held,
                       report["peak_allocated_bytes"], report["peak_reserved_bytes"],
                       host=report.get("host_state_bytes", 0))


def _largest_fitting(fits: Callable[[int], bool], start: int) -> int:
    """The largest ``b`` in ``[1, MAX_BATCH_LIMIT]`` with ``fits(b)`` (0 if none), fitting
    being monotone in ``b``: doubling up from ``start`` or halving down from it until the
    answer is bracketed, then bisecting."""
    b = max(1, min(start, MAX_BATCH_LIMIT))
    if fits(b):
        lo = b
        while True:
            if lo >= MAX_BATCH_LIMIT:
                return lo
            b = min(2 * lo, MAX_BATCH_LIMIT)
            if not fits(b):
                hi = b
                break
            lo = b
    else:
        lo, hi = 0, b
        while hi > 1:
            b = hi // 2
            if fits(b):
                lo = b
                break
            hi = b
        if lo == 0:
            return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def estimate_table(make_net: Callable[[], Network], input_shape: tuple[int, ...],
                   batch_size: int, memory: str | MemoryConfig, ranks: Sequence[int],
                   optimizer: str = "sgd", stages: Sequence[int] = (0, 1, 2, 3),
                   budget: int | None = None, progress: Callable[[str], None] | None = None,
                   **dry_kwargs: Any) -> list[EstimateRow]:
    """The table's rows: for each rank count in ``ranks`` and each ZeRO stage in ``stages``
    (stage 0 only for one rank; none where the spec refuses the stage), a dry run of rank 0
    (the largest shard) of the global ``batch_size`` under ``memory`` with ``zero=`` that
    stage; with ``budget`` (bytes of one rank's device) also the largest batch per rank whose
    peak reserved fits it (dry runs at ``ranks x b`` samples, galloping then bisecting).
    ``dry_kwargs`` go to :func:`~minidl.analysis.dryrun.dry_run` (``target``,
    ``device_kind``, ``label_shape``)."""
    rows = []
    for n in ranks:
        if n < 1 or n > batch_size:
            raise ValueError(f"rank count {n}: needs 1 to the batch size ({batch_size})")
        for stage in (stages if n > 1 else (0,)):
            spec = _spec_with_stage(memory, stage)
            if spec is None:
                continue

            def report(global_batch: int, n: int = n, spec: MemoryConfig = spec) -> dict:
                return dry_run(make_net(), global_batch, spec, optimizer,
                               input_shape=input_shape, ranks=n, **dry_kwargs)

            row = _row(report(batch_size), stage, n)
            if budget is not None:
                if progress:
                    progress(f"  ZeRO stage {stage}, {n} rank(s): searching the largest batch "
                             f"per rank within {format_size(budget)}...")

                def fits(b: int, n: int = n, report: Callable = report) -> bool:
                    return report(b * n)["peak_reserved_bytes"] <= budget

                row = replace(row, max_batch_per_rank=_largest_fitting(fits, row.batch_per_rank))
            rows.append(row)
    return rows


def format_estimate_table(rows: Sequence[EstimateRow], budget: int | None = None) -> str:
    """The rows as the text table ``minidl plan --table`` prints (binary units, per rank)."""
    cols = ["ZeRO", "ranks", "batch/rank", "parameters", "gradients", "optimizer",
            "activations", "workspace", "peak/rank", "reserved/rank"]
    if budget is not None:
        cols.append("max batch/rank")
    host = any(r.host for r in rows)
    if host:
        cols.append("host/rank")
    lines = []
    for r in rows:
        cells = [str(r.stage), str(r.ranks), str(r.batch_per_rank),
                 *(format_size(v) for v in asdict(r.held).values()),
                 format_size(r.peak_allocated), format_size(r.peak_reserved)]
        if budget is not None:
            cells.append(str(r.max_batch_per_rank))
        if host:
            cells.append(format_size(r.host))
        lines.append(cells)
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)
