"""``minidl plan``: the dry run of a model on the meta device (exact peak, no compute)."""

from __future__ import annotations

import argparse
import json
import sys

from ..dryrun import dry_run, max_batch_size, suggest_specs
from ..memory.auto import BudgetTooSmall
from ..memory.targets import get_target
from ..memory.units import parse_size
from ..report import format_layer_table
from .common import (
    EXIT_OOM,
    UsageError,
    build_model,
    format_bytes,
    parse_memory,
    print_memory_report,
    shape_and_classes,
    with_budget,
)
from .compress import cmd_plan_inference


def _target(args: argparse.Namespace):
    """``--target``: a device profile, or ``None``; a bad name is a one-line usage error."""
    if args.target is None:
        return None
    try:
        return get_target(args.target)
    except ValueError as e:
        raise UsageError(f"--target: {e}") from None


def print_prediction(pred: dict, out=sys.stdout) -> None:
    """The cost model's lines of ``minidl plan --target``."""
    print(f"predicted on {pred['target_description']}:", file=out)
    print(f"  step time:             {1e3 * pred['step_s']:.1f} ms (an unlimited-memory "
          f"device: {1e3 * pred['oracle_s']:.1f} ms; overhead {100 * pred['overhead']:.1f} %)",
          file=out)
    print(f"  stall waiting for copies: {1e3 * pred['stall_s']:.1f} ms per step; recomputed "
          f"forward {1e3 * pred['recompute_s']:.1f} ms; codecs {1e3 * pred['codec_s']:.1f} ms",
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


def cmd_plan(args: argparse.Namespace) -> int:
    if args.inference or args.compressed is not None:
        return cmd_plan_inference(args)
    if args.model is None:
        raise UsageError("minidl plan needs a MODEL (or --inference --compressed FILE)")
    profile = _target(args)
    if profile is not None and args.budget is None and "budget=" not in args.memory:
        args.budget = str(profile.capacity_bytes)  # the target's memory is the default budget
    spec = parse_memory(with_budget(args.memory, args.budget))
    shape, classes = shape_and_classes(args)
    net = build_model(args.model, shape, classes, args.width)
    shape = shape or net.input_shapes[0]
    if args.max_batch:
        if args.budget is None:
            raise UsageError("--max-batch needs --budget SIZE")
        found = max_batch_size(lambda: build_model(args.model, shape, classes, args.width),
                               shape, spec, parse_size(args.budget), args.optimizer,
                               progress=not args.json)
        out = {"model": net.name, "memory": spec.spec, "budget_bytes": parse_size(args.budget),
               "max_batch_size": found["max_batch_size"],
               "limit_reached": found.get("limit_reached", False),
               "report": found["report"]}
        if args.json:
            print(json.dumps(out))
        else:
            print(f"largest batch of {net.name} ({'x'.join(map(str, shape))}) that fits "
                  f"{format_bytes(out['budget_bytes'])} with memory {spec.spec!r}: "
                  f"{out['max_batch_size']}")
            if found["report"]:
                print_memory_report(found["report"])
        return 0
    try:
        budget = None if args.budget is None else parse_size(args.budget)
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
    if args.ranks < 1 or args.ranks > args.batch_size:
        raise UsageError(f"--ranks {args.ranks}: needs 1 to the batch size ({args.batch_size})")
    try:
        rep = dry_run(net, args.batch_size, spec, args.optimizer, input_shape=shape,
                      plot=args.plot, trace=args.trace, budget=budget,
                      device_kind=args.device, target=profile, ranks=args.ranks)
    except BudgetTooSmall as e:
        print(f"minidl: {e}", file=sys.stderr)
        fits = suggest_specs(lambda: build_model(args.model, shape, classes, args.width),
                             args.batch_size, shape, budget or spec.budget, args.optimizer)
        print("  specs that fit: " + (", ".join(
            f"{f['memory']!r} ({format_bytes(f['peak_reserved_bytes'])})" for f in fits) or "none"),
            file=sys.stderr)
        return EXIT_OOM
    if budget is not None:
        rep["budget_bytes"] = budget
        rep["fits_budget"] = rep["peak_reserved_bytes"] <= budget
    if args.json:
        print(json.dumps(rep))
    else:
        print(f"{net.name}, batch {args.batch_size}, input "
              f"{'x'.join(map(str, rep['input']))}, {classes} classes: "
              f"{rep['num_steps']} steps, {rep['num_tensors']} tensors")
        print_memory_report(rep, out=sys.stdout)  # the stream now (tests capture it)
        if rep.get("zero"):
            print_ranks(rep)
        if rep.get("prediction"):
            print_prediction(rep["prediction"])
        if budget is not None:
            print(f"  budget {format_bytes(budget)}: the plan "
                  + ("fits" if rep["fits_budget"] else "does NOT fit")
                  + " (peak reserved against the budget)")
        if args.layers:
            if rep["split"] > 1:
                print(f"layers of one micro-batch of {rep['micro_batch_size']} (the batch of "
                      f"{args.batch_size} runs as {rep['split']} micro-batches):")
            print(format_layer_table(rep["layers"]))
        for what, path in (("timeline", args.plot), ("trace", args.trace)):
            if path:
                print(f"{what} saved to {path}")
    return 0 if rep.get("fits_budget", True) else EXIT_OOM
