"""The meta dry run: the exact peak of a training iteration, without data or compute, and
what dry runs answer.

:func:`dry_run` (:mod:`~minidl.analysis.meta_run`) runs one iteration on the meta device;
:func:`frontier` gives the auto planner's curve, :func:`auto_device_memory` the device bytes a
run needs, :func:`suggest_specs` the specs that fit a capacity and :func:`max_batch_size`
(:mod:`~minidl.analysis.batch_search`) the largest batch that fits a budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..memory.cost.targets import DeviceProfile
from ..memory.ir.config import MemoryConfig
from ..memory.ir.names import DeviceKind
from ..memory.ir.units import parse_size, size_text
from ..memory.planners.auto import BelowFloor, BudgetTooSmall
from ..net.graph import Network
from .batch_search import (  # noqa: F401 (re-exported: minidl.analysis.dryrun's names)
    _JOB,
    LEAN_SPECS,
    MAX_SPLIT,
    _BatchSearch,
    _job_dry_run,
    max_batch_size,
)
from .meta_run import dry_run
from .rank_view import zero_what  # noqa: F401 (re-exported)


def frontier(net: Network | Callable[[], Network], batch_size: int,
             input_shape: tuple[int, ...] | None = None, target: str | DeviceProfile | None = None,
             budget: int | str | None = None, optimizer: str = "sgd",
             memory: str = "auto", **kwargs: Any) -> list[dict[str, Any]]:
    """The auto planner's curve for one training iteration of ``net`` (a network, or a function
    making one): every plan no other beats on both peak and predicted step time, by
    increasing peak, from the least the planner reaches to the unconstrained peak.

    Each point is a dict: ``peak_bytes`` (what the run reaches, the persistent state
    included), ``peak_over_lower_bound`` (that over the program's ``lower_bound_bytes``),
    ``step_s`` (predicted seconds per iteration: ``target``'s cost model, else FLOPs at an
    assumed rate), ``overhead`` (over an unlimited-memory device's time), ``lower_bound_s``
    (a lower bound on every plan of the whole batch at that peak, memory/planners/
    certificate.py; None with the batch split),
    ``source`` and ``summary`` (the plan and what it does) and ``chosen`` (the plan picked for
    ``budget``: bytes or a size such as ``"2GiB"``; default the target's memory, else none).
    The step time never rises with the peak by more than the 0.5 % within which ties go to
    the plan moving and recomputing fewer bytes. ``memory`` is an ``auto`` spec (``auto``, or
    with ``split=K`` or ``zero=K``); ``kwargs`` go to :func:`dry_run` (``label_shape``,
    ``device_kind``, ``ranks``, ...). The whole report, with the lower bound at the budget,
    is ``dry_run(...)["auto"]``.

    Raises :class:`~minidl.memory.planners.auto.BudgetTooSmall` when nothing fits ``budget`` and
    ``ValueError`` for a spec without ``auto``."""
    config = MemoryConfig.parse(memory)
    if not config.has("auto"):
        raise ValueError(f"frontier() is the auto planner's curve: memory must contain 'auto', "
                         f"got {config.spec!r}")
    if budget is not None:
        config = MemoryConfig({**config.flags, "budget": str(parse_size(budget))})
    if not isinstance(net, Network):
        net = net()
    rep = dry_run(net, batch_size, config, optimizer, input_shape=input_shape, target=target,
                  **kwargs)
    return list(rep["auto"].get("curve", []))


def auto_device_memory(net: Network, batch_size: int, memory: str | MemoryConfig,
                       optimizer: str, input_shape: tuple[int, ...],
                       device_kind: str = "cpu",
                       emulate_link: str | DeviceProfile | None = None,
                       precision: str = "fp32") -> int:
    """Device bytes a run needs: the larger reserved peak of a training and an evaluation
    iteration (dry runs for ``device_kind``), rounded up to a MiB, plus one MiB of headroom.
    On a GPU also room for CuPy's own temporaries, which the first step measures (a dry run
    cannot): the largest tensor of the program (they are masks and small reductions of
    feature maps: at most a quarter of the largest map in the reference models).
    ``emulate_link``: for a run emulating that target's link (its plans). ``precision``: what
    training computes in (evaluation runs in float32)."""
    train = dry_run(net, batch_size, memory, optimizer, input_shape=input_shape,
                    device_kind=device_kind, target=emulate_link, emulated=True,
                    precision=precision)
    evaluate = dry_run(net, batch_size, memory, optimizer, input_shape=input_shape,
                       training=False, device_kind=device_kind, target=emulate_link,
                       emulated=True)
    need = max(train["peak_reserved_bytes"], evaluate["peak_reserved_bytes"])
    if device_kind != DeviceKind.CPU:
        need += max(train["largest_tensor_bytes"], evaluate["largest_tensor_bytes"])
    mib = 1 << 20
    return (-(-need // mib) + 1) * mib


#: Specs tried when suggesting what would fit (cheapest in time first).
SUGGESTIONS = ("reuse,inplace", "reuse,inplace,static", "gist,static", "vdnn-all",
               "reuse,inplace,recompute=cost", "reuse,inplace,recompute=sqrt,swap=all,static")


def suggest_specs(make_net, batch_size: int, input_shape: tuple[int, ...], capacity: int,
                  optimizer: str = "sgd", auto_tried: bool = False,
                  **keywords: Any) -> list[dict[str, Any]]:
    """Memory specs whose dry-run reserved peak fits ``capacity`` bytes, with their peaks, and
    the auto planner's plan for that budget if it finds one. ``keywords`` go to every dry run
    (``precision``, ``device_kind``, ``target``, ``ranks``: the run the specs are for).

    None at once where ``capacity`` is under the peak floor of every plan (:class:`BelowFloor`:
    the auto planner says so before any search). ``auto_tried``: the caller's own auto plan
    for this budget already found nothing, so it is not searched again. The fixed specs keep
    the persistent state on the device: once it alone fills ``capacity`` none of them is run."""
    auto = f"auto,budget={size_text(capacity)}"  # as people read it; parses the same
    reports: dict[str, dict[str, Any]] = {}
    for spec in (() if auto_tried else (auto,)) + SUGGESTIONS:
        try:
            reports[spec] = dry_run(make_net(), batch_size, spec, optimizer,
                                    input_shape=input_shape, **keywords)
        except BelowFloor:
            return []
        except BudgetTooSmall:
            continue
        if spec != auto and reports[spec]["persistent_bytes"] >= capacity:
            break
    return [{"memory": spec, "peak_reserved_bytes": rep["peak_reserved_bytes"],
             "split": rep["split"]}
            for spec, rep in ((s, reports[s]) for s in (*SUGGESTIONS, auto) if s in reports)
            if rep["peak_reserved_bytes"] <= capacity]
