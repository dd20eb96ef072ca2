"""``minidl plan``: the dry run of a model on the meta device (exact peak, no compute)."""

from __future__ import annotations

import argparse
import json
import sys

from ..analysis.dryrun import dry_run, max_batch_size, suggest_specs
from ..analysis.estimate import estimate_table, format_estimate_table
from ..analysis.host_report import host_budget_error
from ..analysis.report import format_layer_table
from ..interop.memory_viz import is_pickle_path, open_hint
from ..memory.cost.targets import get_target
from ..memory.ir.precision import Precision
from ..memory.ir.units import format_duration, parse_size
from ..memory.planners.auto import BelowFloor, BudgetTooSmall
from ..net.deferred_init import deferred_parameters
from .common import (
    EXIT_OOM,
    RuntimeFailure,
    UsageError,
    build_model,
    format_bytes,
    parse_memory,
    parse_size_flag,
    print_memory_report,
    shape_and_classes,
    with_budget,
)
from .compress import cmd_plan_inference
from .precision_option import precision_of, print_precision


def _target(args: argparse.Namespace):
    """``--target``: a device profile, or ``None``; a bad name is a one-line usage error."""
    if args.target is None:
        return None
    try:
        return get_target(args.target)
    except ValueError as e:
        raise UsageError(f"--target: {e}") from None


def print_prediction(pred: dict, out=sys.stdout, host: dict | None = None) -> None:
    """The cost model's lines of ``minidl plan --target``; with ``host`` (the report's
    ``host_update``, ``offload=optimizer``) the step time is the whole step: the device's
    iteration, then the host update and the parameters' copy back."""
    print(f"predicted on {pred['target_description']}:", file=out)
    t = format_duration
    step, parts = pred["step_s"], ""
    if host:
        step += host["host_update_s"] + host["parameter_upload_s"]
        parts = (f": the device's {t(pred['step_s'])}, the host update "
                 f"{t(host['host_update_s'])}, the parameters back "
                 f"{t(host['parameter_upload_s'])}")
    overhead = step / pred["oracle_s"] - 1 if host and pred["oracle_s"] else pred["overhead"]
    print(f"  step time:             {t(step)}{parts} (an unlimited-memory "
          f"device: {t(pred['oracle_s'])}; overhead {100 * overhead:.1f} %)",
          file=out)
    print(f"  stall waiting for copies: {t(pred['stall_s'])} per step; recomputed "
          f"forward {t(pred['recompute_s'])}; codecs {t(pred['codec_s'])}",
          file=out)
    print(f"  host link per step:    {format_bytes(pred['offloaded_bytes'])} to host, "
          f"{format_bytes(pred['prefetched_bytes'])} back", file=out)


def print_ranks(rep: dict, out=sys.stdout) -> None:
    """The data-parallel lines of ``minidl plan --ranks N``: one rank's persistent bytes under
    its ZeRO stage against unsharded, and the bytes each collective moves per step."""
    z = rep["zero"]
    print(f"one of {rep['ranks']} data-parallel ranks (shard {rep['batch_size']} of the global "
          f"batch {rep['global_batch_size']}), ZeRO stage {z['stage']}: peak allocated "
          f"{format_bytes(rep['peak_allocated_bytes'])}", file=out)
    for cat, label in (("parameter", "parameters"), ("gradient", "gradients"),
                       ("optimizer_state", "optimizer state")):
        print(f"  {label + ':':18s}{format_bytes(z['persistent_bytes'][cat]):>12s} per rank "
              f"(unsharded {format_bytes(z['unsharded_bytes'][cat])})", file=out)
    if z["stage"] >= 2:
        print("  (full gradients are blocks of the iteration, freed once copied into their "
              "bucket: the peak counts those live at once)", file=out)
    if z["gather_bytes"]:
        print(f"  (parameters are gathered whole per step into blocks of the iteration, the "
              f"largest layer's {format_bytes(z['gather_bytes'])}: the peak counts those live "
              "at once)", file=out)
    for c in z["collectives"]:
        print(f"  {c['name']}: {format_bytes(c['payload_bytes'])} buffer, each rank sends "
              f"{format_bytes(c['sent_bytes_per_rank'])} per step (ring)", file=out)


def _check_frontier(args: argparse.Namespace, spec) -> None:
    """``--frontier``: the auto planner's curve, so a spec with ``auto`` (one-line usage
    errors otherwise)."""
    if not getattr(args, "frontier", False):
        return
    if args.inference or args.compressed is not None:
        raise UsageError("--frontier is the auto planner's curve of a training step: drop "
                         "--inference / --compressed")
    if args.max_batch:
        raise UsageError("--frontier and --max-batch are separate questions: give one of them")
    if not spec.has("auto"):
        raise UsageError(f"--frontier needs --memory auto (or auto,budget=SIZE): the curve is "
                         f"the auto planner's, got --memory {args.memory!r}")
    for flag in ("only", "planner"):
        if spec.has(flag):
            raise UsageError(f"--frontier: auto with {flag}= plans without a curve (the greedy "
                             f"walk or the MILP); use --memory auto[,budget=SIZE]")


def print_frontier(rep: dict, budget: int | None, out=None) -> None:
    """The table of ``minidl plan --frontier``: one row per plan of the auto planner's curve
    by increasing peak (bytes, the persistent state included; and as a multiple of the
    program's lower bound), its predicted step time, overhead over an unlimited-memory device
    and what it does; ``*`` marks the plan chosen for the budget."""
    out = out or sys.stdout  # (the stream now: tests capture it)
    auto = rep["auto"]
    lb = auto["lower_bound_bytes"]
    unit, scale = time_unit([p["step_s"] for p in auto["curve"]])  # (one per column)
    head = f"{'':2s}{'peak MiB':>11s} {'x LB':>6s} {'step ' + unit:>10s} {'overhead':>9s}"
    bounded = any(p["lower_bound_s"] is not None for p in auto["curve"])
    if bounded:
        head += f" {'bound ' + unit:>9s}"
    print(f"the auto planner's curve ({len(auto['curve'])} plans, least peak to unconstrained; "
          f"x LB: multiples of the program's lower bound {format_bytes(lb)})"
          + (f"; times are {auto['split']} micro-batches'" if auto["split"] > 1 else ""),
          file=out)
    print(head + "  plan", file=out)
    for p in auto["curve"]:
        row = (f"{'*' if p['chosen'] else ' ':2s}{p['peak_bytes'] / 2**20:11.2f} "
               f"{p['peak_over_lower_bound'] or 0:6.2f} {scale * p['step_s']:10.2f} "
               f"{100 * p['overhead']:+8.1f}%")
        if bounded:
            low = p["lower_bound_s"]
            row += f" {'' if low is None else f'{scale * low:.2f}':>9s}"
        print(f"{row}  {p['source']}: {p['summary']}", file=out)
    where = (f"for the budget {format_bytes(budget)}" if budget is not None
             else "without a budget")
    line = (f"chosen (*) {where}: peak {format_bytes(auto['chosen_peak_bytes'])}, "
            f"{format_duration(auto['chosen_step_s'])} per step")
    if auto["lower_bound_s"] is not None:
        gap = auto["chosen_step_s"] / auto["lower_bound_s"] - 1 if auto["lower_bound_s"] else 0
        line += ("; lower bound over every plan of the whole batch at this budget "
                 f"{format_duration(auto['lower_bound_s'])} "
                 f"({100 * max(0.0, gap):.1f} % above it)")
    print(line + f"; an unlimited-memory device: {format_duration(auto['oracle_s'])}", file=out)


def time_unit(seconds: list[float]) -> tuple[str, float]:
    """The unit of a column or axis of step times, and the factor from seconds: s where a
    step takes over 10 s (bert-base's plans), else ms."""
    return ("s", 1.0) if max(seconds, default=0) > 10 else ("ms", 1e3)


def plot_frontier(rep: dict, path: str, title: str, budget: int | None = None) -> None:
    """Predicted step time against the budget (PNG at ``path``): a step line (the time at a
    budget is that of the fastest plan whose peak fits it), the curve's plans as points, a
    few of them labelled, the chosen budget and the program's lower bound as vertical lines
    and the unlimited-memory device's time as a horizontal one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'minidl[plot]'") from None
    auto = rep["auto"]
    pts = auto["curve"]
    xs = [p["peak_bytes"] / 2**20 for p in pts]
    unit, scale = time_unit([p["step_s"] for p in pts])
    ys = [scale * p["step_s"] for p in pts]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    right = max(xs[-1] * 1.08, (budget or 0) / 2**20 * 1.02)
    ax.step(xs + [right], ys + [ys[-1]], where="post", color="C0", lw=1.5,
            label="auto: fastest plan that fits")
    ax.plot(xs, ys, "o", color="C0", ms=3.5)
    ax.axvspan(min(xs[0], (auto["lower_bound_bytes"] or 0) / 2**20), xs[0], color="0.9",
               label="no plan fits")
    gap, last = (right - xs[0]) / 7, None  # about seven labels, spread over the budgets
    for i, p in enumerate(pts):
        if last is None or xs[i] - last >= gap or p["chosen"]:
            name = p["source"] if len(p["source"]) <= 30 else p["source"][:29] + "…"
            ax.annotate(name, (xs[i], ys[i]), textcoords="offset points",
                        xytext=(4, 6 if i % 2 else 14), fontsize=7)
            last = xs[i]
    ax.axhline(scale * auto["oracle_s"], color="k", ls="--", lw=0.8,
               label=f"unlimited memory {scale * auto['oracle_s']:.2f} {unit}")
    lb = auto["lower_bound_bytes"]
    if lb:
        ax.axvline(lb / 2**20, color="grey", ls=":", lw=1.0,
                   label=f"lower bound of memory {lb / 2**20:.1f} MiB")
    chosen = [i for i, p in enumerate(pts) if p["chosen"]]
    if chosen:
        i = chosen[0]
        ax.plot([xs[i]], [ys[i]], "o", color="C3", ms=8, mfc="none", mew=1.5,
                label=f"chosen: {ys[i]:.2f} {unit} at {xs[i]:.1f} MiB")
    if budget is not None:
        ax.axvline(budget / 2**20, color="C3", lw=1.0, label=f"budget {budget / 2**20:.1f} MiB")
    ax.set_xlabel("budget (MiB, persistent state included)")
    ax.set_ylabel(f"predicted step time ({unit})")
    ax.set_ylim(0, max(ys) * 1.2)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_plan(args: argparse.Namespace) -> int:
    """``minidl plan``: the options checked, the model built, then one of its questions (the
    largest batch, the estimate table, or the dry run's report, curve or JSON). Models are
    built with deferred parameters: a plan reads shapes only, so no weight is drawn."""
    with deferred_parameters():
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    args.precision = precision_of(args)
    if args.precision is not Precision.FP32 and args.compressed is not None:
        raise UsageError(f"--precision {args.precision}: a compressed file's inference plan is "
                         "fp32 only (its weights decode to float32); plan the dense MODEL "
                         "with --inference")
    if args.inference or args.compressed is not None:
        if getattr(args, "frontier", False):
            _check_frontier(args, None)
        return cmd_plan_inference(args)
    if args.model is None:
        raise UsageError("minidl plan needs a MODEL (or --inference --compressed FILE)")
    profile = _target(args)
    spec = _plan_spec(args, profile)
    shape, classes = shape_and_classes(args)
    net = build_model(args.model, shape, classes, args.width)
    shape = shape or net.input_shapes[0]
    if args.max_batch:
        return _max_batch_output(args, net.name, shape, classes, spec, profile)
    try:
        budget = None if args.budget is None else parse_size(args.budget)
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
    ranks = parse_ranks(args.ranks, args.batch_size)
    if getattr(args, "table", False):
        return _table_output(args, net.name, shape, classes, spec, ranks, budget, profile)
    if len(ranks) > 1:
        raise UsageError(f"--ranks {args.ranks} lists several rank counts: add --table for one "
                         "row per ZeRO stage and rank count, or give one count")
    args.ranks = ranks[0]
    rep = _dry_run(args, net, shape, classes, spec, budget, profile)
    if rep is None:
        return EXIT_OOM
    if args.frontier:
        return _frontier_output(args, rep, spec.budget, profile)
    if args.json:
        print(json.dumps(rep))
    else:
        _print_plan(args, net.name, classes, rep, budget)
    return 0 if rep.get("fits_budget", True) else EXIT_OOM


def _plan_spec(args: argparse.Namespace, profile):
    """The memory spec of ``--memory`` and ``--budget`` (the target's memory the default
    budget), checked against ``--frontier``."""
    if profile is not None and args.budget is None and "budget=" not in args.memory:
        args.budget = str(profile.capacity_bytes)  # the target's memory is the default budget
    spec = parse_memory(with_budget(args.memory, args.budget))
    _check_frontier(args, spec)
    return spec


def _max_batch_output(args: argparse.Namespace, name: str, shape: tuple[int, ...],
                      classes: int, spec, profile) -> int:
    """``--max-batch``: the largest batch that fits ``--budget`` (a line, or JSON)."""
    if args.budget is None:
        raise UsageError("--max-batch needs --budget SIZE")
    found = max_batch_size(lambda: build_model(args.model, shape, classes, args.width),
                           shape, spec, parse_size(args.budget), args.optimizer,
                           progress=not args.json, target=profile,
                           device_kind=args.device, precision=args.precision)
    out = {"model": name, "memory": spec.spec, "budget_bytes": parse_size(args.budget),
           "max_batch_size": found["max_batch_size"],
           "limit_reached": found.get("limit_reached", False),
           "tried": found["tried"], "report": found["report"]}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"largest batch of {name} ({'x'.join(map(str, shape))}) that fits "
          f"{format_bytes(out['budget_bytes'])} with memory {spec.spec!r}: "
          f"{out['max_batch_size']}")
    if found["report"]:
        print_memory_report(found["report"])
    return 0


def _dry_run(args: argparse.Namespace, net, shape: tuple[int, ...], classes: int, spec,
             budget: int | None, profile) -> dict | None:
    """The dry run's report, checked against ``budget``; ``None`` when ``auto`` found no
    plan within it (said on stderr, with the specs that fit)."""
    try:
        rep = dry_run(net, args.batch_size, spec, args.optimizer, input_shape=shape,
                      plot=None if args.frontier else args.plot, trace=args.trace,
                      snapshot=getattr(args, "snapshot", None), budget=budget,
                      device_kind=args.device, target=profile, ranks=args.ranks,
                      precision=args.precision)
    except BudgetTooSmall as e:
        print(f"minidl: {e}", file=sys.stderr)
        # (under the floor of every plan of this very program no spec fits: none to try)
        fits = [] if isinstance(e, BelowFloor) else suggest_specs(
            lambda: build_model(args.model, shape, classes, args.width),
            args.batch_size, shape, budget or spec.budget, args.optimizer,
            auto_tried=spec.has("auto"), device_kind=args.device, target=profile,
            ranks=args.ranks, precision=args.precision)
        print("  specs that fit: " + (", ".join(
            f"{f['memory']!r} ({format_bytes(f['peak_reserved_bytes'])})" for f in fits) or "none"),
            file=sys.stderr)
        return None
    refused = host_budget_error(rep, parse_size_flag("--host-memory",
                                                     getattr(args, "host_memory", None)))
    if refused is not None:
        print(f"minidl: {refused}", file=sys.stderr)
        return None
    if budget is not None:
        rep["budget_bytes"] = budget
        rep["fits_budget"] = rep["peak_reserved_bytes"] <= budget
    return rep


def _print_plan(args: argparse.Namespace, name: str, classes: int, rep: dict,
                budget: int | None) -> None:
    """The dry run's report as text: the header, the memory report, the ranks' and the
    prediction's lines, the budget's verdict, the layer table and the files saved."""
    print(f"{name}, batch {args.batch_size}, input "
          f"{'x'.join(map(str, rep['input']))}, {classes} classes: "
          f"{rep['num_steps']} program steps, {rep['num_tensors']} tensors")
    print_memory_report(rep, out=sys.stdout)  # the stream now (tests capture it)
    if rep.get("zero"):
        print_ranks(rep)
    if rep.get("prediction"):
        print_prediction(rep["prediction"], host=rep.get("host_update"))
    if rep.get("precision"):
        print_precision(rep, out=sys.stdout)
    if budget is not None:
        print(f"  budget {format_bytes(budget)}: the plan "
              + ("fits" if rep["fits_budget"] else "does NOT fit")
              + " (peak reserved against the budget)")
    if args.layers:
        if rep["split"] > 1:
            print(f"layers of one micro-batch of {rep['micro_batch_size']} (the batch of "
                  f"{args.batch_size} runs as {rep['split']} micro-batches):")
        print(format_layer_table(rep["layers"]))
    snapshot = getattr(args, "snapshot", None)
    for what, path in (("timeline", args.plot), ("trace", args.trace),
                       ("memory snapshot", snapshot)):
        if path:
            print(f"{what} saved to {path}" + (
                "" if what != "memory snapshot" else f" (PyTorch's format: {open_hint(path)})"
                if is_pickle_path(path) else f" (minidl show-memory {path})"))


def parse_ranks(text: str | int, batch_size: int) -> list[int]:
    """``--ranks N`` or ``--ranks 1,2,8``: the rank counts, each from 1 to the batch size (the
    batch is global); one-line usage errors otherwise."""
    try:
        counts = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--ranks {text}: expected a count or counts separated by commas "
                         "(e.g. 8 or 1,2,8)") from None
    for n in counts:
        if n < 1 or n > batch_size:
            raise UsageError(f"--ranks {text}: needs 1 to the batch size ({batch_size}), "
                             f"got {n}")
    return sorted(set(counts))


def _table_output(args: argparse.Namespace, name: str, shape: tuple[int, ...], classes: int,
                  spec, ranks: list[int], budget: int | None, profile) -> int:
    """``--table``: one row per ZeRO stage and rank count (a dry run each), with the largest
    batch per rank that fits ``--budget`` (or the target's memory)."""
    if args.frontier or args.max_batch:
        raise UsageError("--table is its own question: drop --frontier / --max-batch")
    if spec.has("auto"):
        raise UsageError("--table compares fixed specs across ZeRO stages: give --memory "
                         "without auto (e.g. reuse,inplace)")
    say = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    rows = estimate_table(lambda: build_model(args.model, shape, classes, args.width), shape,
                          args.batch_size, spec, ranks, args.optimizer, budget=budget,
                          progress=say, device_kind=args.device, target=profile,
                          precision=args.precision)
    if args.json:
        print(json.dumps({"model": name, "memory": spec.spec, "batch_size": args.batch_size,
                          "budget_bytes": budget, "rows": [r.as_dict() for r in rows]}))
        return 0
    print(f"{name}, global batch {args.batch_size}, input {'x'.join(map(str, shape))}, memory "
          f"{spec.spec!r}, optimizer {args.optimizer}: one rank's bytes at its peak"
          + (f"; max batch/rank within {format_bytes(budget)}" if budget is not None else ""))
    print(format_estimate_table(rows, budget))
    return 0


def _frontier_output(args: argparse.Namespace, rep: dict, budget: int | None, profile) -> int:
    """``--frontier``: the curve's table (or the report with it as JSON) and its plot."""
    if not rep.get("auto"):
        raise RuntimeFailure(
            f"the auto planner made no curve for {rep['model']} (the network makes its own "
            "memory choices on some blocks, and auto then takes the greedy walk)")
    title = (f"{rep['model']}, batch {rep['batch_size']}, input "
             f"{'x'.join(map(str, rep['input']))}"
             + (f", {profile.name}" if profile is not None else "")
             + ": predicted step time against the budget")
    if args.plot:
        plot_frontier(rep, args.plot, title, budget)
    if args.json:
        print(json.dumps(rep))
        return 0 if rep.get("fits_budget", True) else EXIT_OOM
    print(f"{rep['model']}, batch {rep['batch_size']}, input "
          f"{'x'.join(map(str, rep['input']))}"
          + (f", on {profile.describe()}" if profile is not None else
             " (step times: the cost model's FLOPs at an assumed rate)"))
    print_frontier(rep, budget)
    if args.plot:
        print(f"frontier saved to {args.plot}")
    return 0 if rep.get("fits_budget", True) else EXIT_OOM
