"""The meta dry run: the exact peak of a training iteration, without data or compute
(:func:`dry_run`), and its report."""

from __future__ import annotations

from typing import Any, Unpack

from ..compile.engine import Engine, micro_shapes
from ..layers import SoftmaxCrossEntropy
from ..memory.cost.cost_model import simulate
from ..memory.cost.targets import DeviceProfile, get_target
from ..memory.devices.device import MetaDevice
from ..memory.ir.config import MemoryConfig
from ..memory.ir.names import DeviceKind
from ..memory.ir.plan import AutoChoice, CurvePoint
from ..memory.passes.zero import ZeroBytes, zero_bytes
from ..memory.runtime.pool import Pool
from ..net.graph import Network
from ..net.labels import default_label_shape
from ..net.optim import make_optimizer
from . import report
from .dry_run_options import DryRunKeywords, DryRunOptions, DryRunOutputs
from .host_report import host_figures
from .memory_record import plan_snapshot
from .precision_report import precision_report
from .rank_view import rank_breakdown, rank_live_tensors, zero_report, zero_what


def dry_run(net: Network, batch_size: int, memory: str | MemoryConfig = "none",
            optimizer: str = "sgd", options: DryRunOptions | None = None,
            **keywords: Unpack[DryRunKeywords]) -> dict[str, Any]:
    """Run one training iteration of ``net`` on the meta device and report its memory.

    ``options`` (:class:`~minidl.analysis.dry_run_options.DryRunOptions`) groups what follows;
    each of its fields is taken as a keyword too (``dry_run(net, 32, "auto", target="a100")``).

    The pool places every block exactly as a real run would, so ``peak_allocated_bytes``
    equals a real run's. Keys: ``peak_allocated_bytes``, ``peak_reserved_bytes``,
    ``lower_bound_bytes``, ``persistent_bytes``, ``breakdown`` (bytes by category at the peak),
    ``peak_step`` (layer, phase, index), ``live_at_peak`` (the largest tensors live there),
    ``split`` and ``micro_batch_size`` (the batch runs as ``split`` micro-batches; the peak and
    ``layers`` are those of one micro-batch, the largest). ``budget`` (bytes, default the auto
    planner's) is drawn as a line on the ``plot``. ``alignment`` is the allocation unit of the
    pool to simulate (that of the real run's pool). ``device_kind="cuda"`` plans for a GPU (its
    layers' workspaces); ``scratch_bytes`` is the block a GPU run reserves for CuPy's own
    temporaries (measured at its first step: ``Trainer.engine.scratch.size``), without which
    the dry run's peak leaves it out.

    ``target`` (a name of :mod:`~minidl.memory.cost.targets` or a profile) plans for that GPU: the
    cuda kind's workspaces, the planners' step times and link rate from its cost model, ``auto``
    without ``budget=`` gets the target's capacity, and the report's ``prediction`` gives the
    predicted iteration time, an unlimited-memory device's (vDNN's oracle), the overhead, the
    stall and the bytes over the host link (:func:`~minidl.memory.cost.cost_model.simulate`).
    ``emulated=True``: the plans a CPU run emulating the target's link makes
    (``Trainer(emulate_link=)``): the target's costs, ``device_kind`` and ``budget`` as given.

    ``ranks``: one rank of data-parallel training over that many ranks: ``batch_size`` is the
    global batch and the iteration is rank 0's shard (the largest); ``zero`` in the report
    gives the rank's persistent bytes under the spec's ``zero=K``
    (:func:`~minidl.memory.passes.zero.zero_bytes`) and the step's collectives, and
    ``peak_allocated_bytes`` is that rank's, as training measures it at every stage (stage 2's
    full gradients and stage 3's gathered parameters are blocks of the lowered iteration).
    ``snapshot``: write the iteration's memory snapshot there
    (:func:`~minidl.analysis.memory_record.plan_snapshot`): PyTorch's snapshot pickle for a
    ``.pickle`` /
    ``.pkl`` path (https://pytorch.org/memory_viz), minidl's JSON (``minidl show-memory``)
    otherwise; the same events and addresses a real run of the spec records.
    ``precision`` (:mod:`~minidl.memory.ir.precision`): the iteration in ``bf16-mixed`` /
    ``fp16-mixed`` (tensors in the op policy's dtypes) or ``tf32``; other than ``fp32``, the
    report adds ``precision`` and its figures by dtype (:func:`precision_report`).
    """
    options = (options or DryRunOptions()).with_keywords(dict(keywords))
    inputs, device, outputs = options.inputs, options.device, options.outputs
    config, profile, device_kind = _planned_for(memory, device.target, device.emulated,
                                                device.device_kind)
    training, ranks = inputs.training, device.ranks
    shape = tuple(inputs.input_shape) if inputs.input_shape is not None \
        else net.input_shapes[0]
    if shape is None:
        raise ValueError("the network has no input shape: pass input_shape")
    global_batch = int(batch_size)
    batch_size = -(-global_batch // ranks)  # rank 0's shard
    pool = Pool(MetaDevice(kind=device_kind), alignment=device.alignment)
    loss = inputs.loss if inputs.loss is not None else SoftmaxCrossEntropy()
    opt = make_optimizer(optimizer, net.parameters()) if training else None
    engine = Engine(net, pool, config, loss if training else None, opt, bind=False,
                    scratch_bytes=device.scratch_bytes, target=profile,
                    precision=device.precision)
    c, split, micro = _compile_iteration(engine, net, batch_size, shape, inputs.label_shape,
                                         training)
    c.executor.run([None, None], training=training, record=True)
    info = engine.peak_info(c)
    budget = outputs.budget if outputs.budget is not None else config.budget
    _write_records(c, info, net, config, batch_size, budget, outputs)
    swap = c.executor.last_runtime.swap_stats.as_dict()
    swap["host_peak_bytes"] = engine.host_pool.peak_bytes
    prog = c.lowered.program
    zero = zero_bytes(prog, config.zero, ranks, offload=config.offload is not None) \
        if training and (ranks > 1 or config.zero) \
        else None
    peaks, rank_notes = _peak_figures(prog, pool.stats(), info, zero, ranks, outputs.top)
    return {
        "model": net.name,
        "device": "meta" if device_kind == DeviceKind.CPU else f"meta ({device_kind} kind)",
        "memory": config.spec,
        "batch_size": int(batch_size),
        "input": list(shape),
        **peaks,
        "num_steps": len(prog.steps),
        "num_tensors": len(prog.tensors),
        "largest_tensor_bytes": max((t.nbytes for t in prog.tensors if not t.persistent),
                                    default=0),
        "host_peak_bytes": engine.host_pool.peak_bytes,
        **host_figures(engine, profile, ranks),
        "split": split,
        "micro_batch_size": micro,
        "kept_for_backward_bytes": sum(c.executor.last_runtime.kept_for_backward.values()),
        "kept_for_backward": dict(c.executor.last_runtime.kept_for_backward),
        "swap": swap if c.plan.swapping.blocks else {},
        "notes": ([f"batch split into {split} micro-batches of {micro} (moDNN); the peak and "
                   f"the layer table are one micro-batch's"] if split > 1 else [])
        + list(c.plan.notes) + rank_notes,
        "layers": report.layer_table(c),
        "prediction": {} if profile is None else _prediction(c, profile, split),
        "auto": _auto_report(c.plan.provenance.auto, split, prog.lower_bound_bytes()),
        **{k: v for k, v in report.strategy_costs(c).items() if k == "bptt"},
        **({} if zero is None else {"ranks": ranks, "global_batch_size": global_batch,
                                    "zero": zero_report(zero)}),
        **precision_report(c, info, engine.precision, profile),
    }


def _planned_for(memory: str | MemoryConfig, target: str | DeviceProfile | None,
                 emulated: bool, device_kind: str
                 ) -> tuple[MemoryConfig, DeviceProfile | None, str]:
    """The spec, the target's profile and the device kind a dry run plans for: a target (not
    emulated) plans for its GPU (the cuda kind), ``auto`` without a budget for its capacity."""
    config = MemoryConfig.parse(memory)
    profile = get_target(target) if isinstance(target, str) else target
    if profile is not None and not emulated:
        device_kind = "cuda"
        if config.has("auto") and config.budget is None:
            config = MemoryConfig.parse(f"{config.spec},budget={profile.capacity_bytes}")
    return config, profile, device_kind


def _compile_iteration(engine: Engine, net: Network, batch_size: int, shape: tuple[int, ...],
                       label_shape: tuple[int, ...] | None, training: bool
                       ) -> tuple[Any, int, int]:
    """``(compiled, split, micro_batch_size)``: the iteration the engine compiles for the
    batch, as ``split`` micro-batches where the planner splits it (training only)."""
    batch = (int(batch_size), *shape)
    labels = tuple(label_shape or default_label_shape(net, batch))
    split = engine.split_for([batch], labels) if training else 1
    micro = -(-int(batch_size) // split)
    if split > 1:
        shapes, labels = micro_shapes([batch], labels, micro)
        c = engine.compiled(shapes, labels, training=True, accumulate=True)
    else:
        c = engine.compiled([batch], labels, training=training)
    return c, split, micro


def _write_records(c: Any, info: Any, net: Network, config: MemoryConfig, batch_size: int,
                   budget: int | None, outputs: DryRunOutputs) -> None:
    """The files a dry run was asked for: the memory snapshot, the timeline plot (``budget``
    drawn as a line) and the trace."""
    if outputs.snapshot:
        plan_snapshot(c, info, outputs.snapshot, model=net.name, memory=config.spec,
                      budget=budget)
    if outputs.plot:
        report.plot_timeline(report.timeline(c), outputs.plot,
                             f"{net.name}, batch {batch_size}, {config.spec}", budget=budget)
    if outputs.trace:
        report.save_trace(c, outputs.trace, measured=False)


def _rank_note(zero: ZeroBytes, ranks: int) -> str:
    """The note saying whose figures the report gives and what the rank's shard is."""
    head = f"one rank's figures of {ranks}"
    if not zero.stage:
        return f"{head} (no ZeRO: every rank holds the whole training state)"
    if zero.offloaded:
        return (f"{head}: its host holds its shard of the master weights and "
                f"{zero_what(zero.stage)} (offload); its device every parameter")
    return f"{head}: its peak, breakdown and tensors hold its shard of the {zero_what(zero.stage)}"


def _peak_figures(prog: Any, stats: dict[str, int], info: Any, zero: ZeroBytes | None,
                  ranks: int, top: int) -> tuple[dict[str, Any], list[str]]:
    """The report's entries from ``peak_allocated_bytes`` to ``live_at_peak``, one rank's
    under ``zero`` (rank 0's shard: the largest), and the notes saying so."""
    breakdown = dict(info.by_category)
    live = list(info.live)
    lower_bound = prog.lower_bound_bytes()
    notes: list[str] = []
    if zero is not None:  # every figure one rank's (rank 0's shard: the largest)
        stats["allocated_bytes.peak"] -= zero.saved_bytes
        stats["reserved_bytes.peak"] -= zero.saved_bytes
        lower_bound -= zero.saved_bytes
        breakdown = rank_breakdown(prog, zero, breakdown)
        live = rank_live_tensors(prog, zero, live)
        notes.append(_rank_note(zero, ranks))
    return {
        "peak_allocated_bytes": stats["allocated_bytes.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.peak"],
        "lower_bound_bytes": lower_bound,
        "persistent_bytes": prog.persistent_bytes() if zero is None
        else sum(zero.persistent.values()),
        "breakdown": dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
        "peak_step": {"layer": info.step, "phase": info.phase, "index": info.position},
        "live_at_peak": [{"tensor": n, "category": c_, "bytes": b} for n, c_, b in live[:top]],
    }, notes


def _auto_report(choice: AutoChoice | None, split: int, lower_bound_bytes: int
                 ) -> dict[str, Any]:
    """The frontier planner's curve and choice (empty without one: no ``auto``, or the greedy
    walk). Peaks are one micro-batch's (the device's); times are the whole iteration's, the
    ``split`` micro-batches one after another. The certificate covers plans of one program:
    with the batch split, none is given (a plan of another split could beat it)."""
    if choice is None or not choice.curve:
        return {}
    oracle = (choice.oracle_s or 0.0) * split

    def point(p: CurvePoint) -> dict[str, Any]:
        low = p.lower_bound_s if split == 1 else None
        return {"peak_bytes": p.peak,
                "peak_over_lower_bound": p.peak / lower_bound_bytes if lower_bound_bytes else None,
                "step_s": p.time_s * split,
                "overhead": p.time_s * split / oracle - 1.0 if oracle > 0 else 0.0,
                "lower_bound_s": None if low is None else low * split,
                "source": p.source, "summary": p.summary, "chosen": p.peak == choice.peak}

    return {"curve": [point(p) for p in choice.curve],
            "chosen_peak_bytes": choice.peak,
            "chosen_step_s": (choice.oracle_s or 0.0) * split + choice.extra_time_s * split,
            "lower_bound_s": None if choice.lower_bound_s is None or split > 1
            else choice.lower_bound_s,
            "oracle_s": oracle, "split": split, "lower_bound_bytes": lower_bound_bytes}



def _prediction(c: Any, profile: DeviceProfile, split: int) -> dict[str, Any]:
    """The cost model's iteration on ``profile`` (``split`` micro-batches run one after
    another: times and bytes scale with it)."""
    p = simulate(c.plan, profile)
    out = p.as_dict()
    for key in ("step_s", "oracle_s", "stall_s", "recompute_s", "codec_s", "offloaded_bytes",
                "prefetched_bytes"):
        out[key] *= split
    out["target_description"] = profile.describe()
    out["capacity_bytes"] = profile.capacity_bytes
    return out
