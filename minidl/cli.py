"""The ``minidl`` command: ``train``, ``plan`` and ``bench``."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

EXIT_USAGE = 2
EXIT_OOM = 1
EXIT_FAILURE = 1


class UsageError(Exception):
    """A bad name or value on the command line (exit code 2)."""


class RuntimeFailure(Exception):
    """A run that cannot go on: missing data, a missing optional extra, no GPU (exit code 1)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one ``minidl: error: ...`` line (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"minidl: error: {message} (see '{self.prog} --help')\n")


def parse_chw(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        dims = tuple(int(p) for p in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise UsageError(f"--input must look like CxHxW (e.g. 3x32x32), got {text!r}") from None
    if len(dims) != 3:
        raise UsageError(f"--input {text} has {len(dims)} dimension(s); the image models take "
                         "channels-first CxHxW, three numbers such as 1x28x28 or 3x32x32")
    if any(d <= 0 for d in dims):
        raise UsageError(f"--input dimensions must be positive, got {text!r}")
    return dims


def _smallest_square_input(name: str, channels: int, num_classes: int,
                           width: int | None) -> int | None:
    """The smallest H = W that model ``name`` accepts with ``channels`` channels (None above
    4096). Failing sizes fail while the graph is built, before any parameter exists."""
    from .layers.base import ShapeError
    from .models import get_model

    for side in range(1, 4097):
        try:
            get_model(name, input_shape=(channels, side, side), num_classes=num_classes,
                      width=width)
        except ShapeError:
            continue
        return side
    return None


def _model(name: str, input_shape, num_classes: int, width: int | None = None):
    from .layers.base import ShapeError
    from .models import get_model

    try:
        return get_model(name, input_shape=input_shape, num_classes=num_classes, width=width)
    except ShapeError as e:
        if input_shape is None or len(input_shape) != 3:
            raise
        c, h, w = input_shape
        side = _smallest_square_input(name, c, num_classes, width)
        if side is None:
            need = f"it takes no input with C={c}"
        elif side == 1:
            need = f"it takes square inputs with C={c} ({c}xHxH)"
        else:
            need = f"the smallest square input it takes with C={c} is {c}x{side}x{side}"
        if w in (1, 3) and c > 3:
            hint = f"; channels last? try --input {w}x{c}x{h}"
        elif side and min(h, w) >= side:
            hint = f"; H and W this unequal are not supported: try {c}x{max(h, w)}x{max(h, w)}"
        else:
            hint = ""
        raise UsageError(
            f"--input {c}x{h}x{w} is too small or the wrong shape for {name} (read channels-first "
            f"as C={c}, H={h}, W={w}): {need}{hint} [{e}]") from None
    except ValueError as e:
        if "unknown model" in str(e) or "no ResNet" in str(e):
            raise UsageError(str(e)) from None
        raise


def check_model_name(name: str) -> None:
    """Raise :class:`UsageError` listing the valid names unless ``name`` is a model."""
    import re

    from .models import MODEL_NAMES, MODELS, TEXT_MODELS, resnet_layout

    if name in MODELS or name in TEXT_MODELS:
        return
    depth = re.fullmatch(r"resnet(\d+)", name)
    if depth is None:
        raise UsageError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    try:
        resnet_layout(int(depth.group(1)))
    except ValueError as e:
        raise UsageError(str(e)) from None


def _size(flag: str, text: str | None) -> int | None:
    from .memory.units import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None


def validate_args(args: argparse.Namespace) -> None:
    """Every number and size on the command line, checked before any work starts: one
    :class:`UsageError` naming the flag, the bad value and what is valid."""
    check_model_name(args.model)

    def at_least(flag: str, value, low) -> None:
        if value is not None and not value >= low:  # "not >=" also catches NaN
            raise UsageError(f"{flag} must be >= {low}, got {value}")

    at_least("--batch-size", args.batch_size, 1)
    at_least("--width", args.width, 1)
    at_least("--seq-len", args.seq_len, 1)
    for flag in ("epochs", "max_steps", "classes", "vocab", "steps"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 1)
    for flag in ("warmup", "seed", "weight_decay"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 0)
    lr = getattr(args, "lr", None)
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr must be a positive finite number, got {lr}")
    _size("--budget", getattr(args, "budget", None))
    _size("--host-memory", getattr(args, "host_memory", None))
    if getattr(args, "device_memory", "auto") != "auto":
        _size("--device-memory", args.device_memory)
    specs = args.memory if isinstance(args.memory, list) else [args.memory]
    for spec in specs:
        _memory(spec)
    if getattr(args, "plot", None):
        _require("matplotlib", "plot", "--plot")


def _require(module: str, extra: str, what: str) -> None:
    """Raise :class:`RuntimeFailure` naming the ``pip install`` that provides ``module``."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise RuntimeFailure(f"{what} needs {module}, which is not installed: "
                             f"pip install 'minidl[{extra}]'") from None


def check_device(name: str) -> None:
    """The cuda device needs CuPy and a GPU: say so before loading data or building models."""
    if name != "cuda":
        return
    import importlib.util

    from .memory.device_factory import make_device

    if importlib.util.find_spec("cupy") is None:
        raise RuntimeFailure("--device cuda needs CuPy, which is not installed: pip install "
                             "'minidl[cuda]' (cupy-cuda12x), or use --device cpu")
    try:
        make_device("cuda", capacity=512)  # a tiny arena: CuPy imports and a GPU answers
    except RuntimeError as e:
        raise RuntimeFailure(f"--device cuda: {e}") from None


def _shape_and_classes(args: argparse.Namespace) -> tuple[tuple[int, ...] | None, int]:
    """Per-sample input shape and output classes: images take --input and --classes; the
    character models take --seq-len and --vocab."""
    from .models import TEXT_MODELS

    if args.model in TEXT_MODELS:
        if args.seq_len < 1:
            raise UsageError(f"--seq-len must be positive, got {args.seq_len}")
        return (args.seq_len,), args.vocab
    return parse_chw(args.input), args.classes


def _memory(spec: str):
    from .memory.config import MemoryConfig

    try:
        return MemoryConfig.parse(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _fmt(n: int) -> str:
    from .memory.units import format_size

    return f"{format_size(n)} ({n:,} B)"


def print_memory_report(rep: dict[str, Any], out=sys.stdout) -> None:
    print(f"memory report ({rep.get('device', 'meta')} device, memory spec "
          f"{rep.get('memory')!r})", file=out)
    if "capacity_bytes" in rep:
        print(f"  device memory:         {_fmt(rep['capacity_bytes'])}", file=out)
    print(f"  peak allocated:        {_fmt(rep['peak_allocated_bytes'])}", file=out)
    print(f"  peak reserved:         {_fmt(rep['peak_reserved_bytes'])}", file=out)
    if "lower_bound_bytes" in rep:
        print(f"  lower bound:           {_fmt(rep['lower_bound_bytes'])}", file=out)
    if "peak_step" in rep:
        ps = rep["peak_step"]
        print(f"  peak reached at:       {ps['layer']} ({ps['phase']}, step {ps['index']})",
              file=out)
    if rep.get("breakdown"):
        print("  bytes by category at the peak:", file=out)
        total = sum(rep["breakdown"].values()) or 1
        for cat, b in rep["breakdown"].items():
            print(f"    {cat:<17} {_fmt(b):>32}  {100 * b / total:5.1f}%", file=out)
    live = rep.get("live_at_peak") or rep.get("largest_live")
    if live:
        print("  largest tensors live at the peak:", file=out)
        for r in live[:5]:
            print(f"    {r['tensor']:<28} {r['category']:<14} {_fmt(r['bytes'])}", file=out)
    for b in rep.get("bptt", []):
        print(f"  BPTT schedule of {b['layer']}: {b['policy']}, {b['states_kept']} hidden states "
              f"kept for {b['units']} units of {b['unit_steps']} steps, "
              f"{b['unit_forwards'] / b['units']:.2f} unit forwards per unit "
              f"(recomputed {b['recomputed_flops'] / 1e9:.2f} GFLOP)", file=out)
    for note in rep.get("notes", []):
        print(f"  note: {note}", file=out)


# ------------------------------------------------------------------------------ train
def _save(trainer, path: str) -> None:
    try:
        trainer.save(path)
    except OSError as e:
        raise RuntimeFailure(f"cannot write checkpoint {path}: {e}") from None


def cmd_train_text(args: argparse.Namespace, spec) -> int:
    """Character-level language model on Shakespeare (or synthetic text)."""
    from .dryrun import auto_device_memory, make_optimizer
    from .rnn import train_language_model
    from .text import TEXT_DATASETS, load_text_dataset
    from .trainer import Trainer

    name = "synthetic-text" if args.dataset == "synthetic" else args.dataset
    if name not in TEXT_DATASETS:
        raise UsageError(f"unknown dataset {args.dataset!r} for {args.model}; valid: "
                         f"{', '.join(TEXT_DATASETS)}")
    try:
        ds = load_text_dataset(name)
    except (ImportError, OSError, ValueError) as e:
        raise RuntimeFailure(f"cannot load dataset {name!r}: {e}") from None
    net = _model(args.model, (args.seq_len,), ds.vocab_size, args.width)
    opt = make_optimizer(args.optimizer, net.parameters(), args.lr, 0.0)
    device_memory = args.device_memory
    if device_memory == "auto":
        device_memory = spec.budget or auto_device_memory(net, args.batch_size, spec,
                                                          args.optimizer, (args.seq_len,))
    trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                      seed=args.seed, clip_grad_norm=5.0, host_memory=args.host_memory)
    steps = args.max_steps or max(1, args.epochs) * 100
    if not args.json:
        print(f"training {net.name} ({net.num_parameters():,} parameters) on {ds.name}: "
              f"{len(ds.train):,} train / {len(ds.val):,} validation characters, vocabulary "
              f"{ds.vocab_size}, seq-len {args.seq_len}, batch {args.batch_size}, {steps} steps, "
              f"memory {spec.spec!r}", file=sys.stderr)
    res = train_language_model(trainer, ds, args.batch_size, args.seq_len, steps,
                               progress=not args.no_progress, seed=args.seed)
    if args.save:
        _save(trainer, args.save)
    rep = trainer.memory_report()
    result = {"model": args.model, "dataset": ds.name, "memory": spec.spec,
              "losses": res["losses"], "final_loss": res["losses"][-1],
              "val_loss": res["val_loss"], "val_perplexity": res["val_perplexity"],
              "peak_allocated_bytes": rep["peak_allocated_bytes"],
              "peak_reserved_bytes": rep["peak_reserved_bytes"],
              "step_time_median_s": float(np.median(res["step_times"])),
              "wall_time_s": res["wall_time_s"], "steps": steps, "memory_report": rep}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"steps: {steps}, final training loss {result['final_loss']:.4f}, median step "
              f"{1000 * result['step_time_median_s']:.1f} ms, wall time {res['wall_time_s']:.1f} s")
        print(f"validation loss {res['val_loss']:.4f} nats/char, perplexity "
              f"{res['val_perplexity']:.2f}")
        print_memory_report(rep)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from . import data as D
    from .dryrun import auto_device_memory, make_optimizer
    from .memory.pool import DeviceOutOfMemory
    from .models import TEXT_MODELS
    from .trainer import Trainer

    defaults = D.train_defaults(args.dataset)
    if args.epochs is None:
        args.epochs = defaults.epochs
    if args.weight_decay is None:
        args.weight_decay = defaults.weight_decay
    spec = _memory(_with_budget(args.memory, args.budget))
    check_device(args.device)
    if args.save:
        from .trainer import check_writable

        try:
            check_writable(args.save)
        except OSError as e:
            raise UsageError(f"--save {args.save}: {e}") from None
    if args.model in TEXT_MODELS:
        return cmd_train_text(args, spec)
    if args.dataset not in D.DATASETS:
        raise UsageError(f"unknown dataset {args.dataset!r}; valid: {', '.join(D.DATASETS)}")
    if args.dataset == "idx" and args.data_dir is None:
        raise UsageError("--dataset idx needs --data-dir DIR, a folder of MNIST-format idx files "
                         "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-...)")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir}: no such folder")
    input_shape = parse_chw(args.input)
    if args.dataset == "synthetic" and input_shape is None:
        from .models import default_input_shape

        input_shape = default_input_shape(args.model)
    try:
        ds = D.load_dataset(args.dataset, data_dir=args.data_dir, input_shape=input_shape,
                            seed=args.seed)
    except (ImportError, OSError, ValueError) as e:
        raise RuntimeFailure(f"cannot load dataset {args.dataset!r}: {e}") from None
    if defaults.standardize:
        ds.standardize()
    net = _model(args.model, ds.input_shape, ds.num_classes, args.width)
    try:
        opt = make_optimizer(args.optimizer, net.parameters(), args.lr, args.weight_decay)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from .optim import CosineAnnealingLR, StepLR

    scheduler = None
    if args.schedule == "cosine":
        scheduler = CosineAnnealingLR(opt, T_max=args.epochs)
    elif args.schedule == "step":
        scheduler = StepLR(opt, step_size=max(1, args.epochs // 3))
    device_memory = args.device_memory
    if device_memory == "auto" and spec.budget is not None:
        device_memory = spec.budget
    elif device_memory == "auto":
        device_memory = auto_device_memory(net, args.batch_size, spec, args.optimizer,
                                           ds.input_shape)
    try:
        trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                          seed=args.seed, scheduler=scheduler, host_memory=args.host_memory)
    except RuntimeError as e:  # the cuda device without a GPU
        raise RuntimeFailure(str(e)) from None
    if not args.json:
        print(f"training {net.name} ({net.num_parameters():,} parameters) on {ds.name}: "
              f"{len(ds.x_train)} train / {len(ds.x_test)} test samples, input "
              f"{'x'.join(map(str, ds.input_shape))}"
              f"{' (standardised with the train mean/std)' if ds.mean is not None else ''}, "
              f"{args.epochs} epochs of batch {args.batch_size}, memory "
              f"{spec.spec!r}, {trainer.device.name} device with {_fmt(trainer.device.capacity)}",
              file=sys.stderr)
    t0 = time.perf_counter()
    try:
        hist = trainer.fit(ds, epochs=args.epochs, batch_size=args.batch_size,
                           max_steps=args.max_steps, progress=not args.no_progress)
    except DeviceOutOfMemory as e:
        from .dryrun import suggest_specs

        fits = suggest_specs(lambda: _model(args.model, ds.input_shape, ds.num_classes,
                                            args.width), args.batch_size, ds.input_shape,
                             trainer.device.capacity, args.optimizer)
        e.suggestions = fits
        raise
    wall = time.perf_counter() - t0
    if args.save:
        _save(trainer, args.save)
    rep = trainer.memory_report()
    result = {
        "model": args.model,
        "dataset": ds.name,
        "memory": spec.spec,
        "losses": hist.losses,
        "final_loss": hist.losses[-1] if hist.losses else None,
        "test_loss": hist.test_loss,
        "test_accuracy": hist.test_accuracy,
        "peak_allocated_bytes": rep["peak_allocated_bytes"],
        "peak_reserved_bytes": rep["peak_reserved_bytes"],
        "step_time_median_s": float(np.median(hist.step_times)) if hist.step_times else None,
        "wall_time_s": wall,
        "steps": len(hist.losses),
        "epochs": args.epochs,
        "weight_decay": args.weight_decay,
        "input_mean": ds.mean,
        "input_std": ds.std,
        "memory_report": rep,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"steps: {len(hist.losses)}, final training loss {result['final_loss']:.4f}, "
              f"median step {1000 * (result['step_time_median_s'] or 0):.1f} ms, "
              f"wall time {wall:.1f} s")
        if hist.test_accuracy is not None:
            print(f"test loss {hist.test_loss:.4f}, test accuracy {100 * hist.test_accuracy:.2f}%")
        print_memory_report(rep)
    return 0


# ------------------------------------------------------------------------------ plan
def _with_budget(spec_text: str, budget: str | None) -> str:
    """The spec with ``budget=`` for the auto planner (other specs take --budget only as the
    limit a dry run is compared with)."""
    if budget is None or "auto" not in spec_text.split(","):
        return spec_text
    from .memory.units import parse_size

    try:
        return f"{spec_text},budget={parse_size(budget)}"
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    from .dryrun import dry_run, max_batch_size
    from .memory.auto import BudgetTooSmall
    from .memory.units import parse_size

    spec = _memory(_with_budget(args.memory, args.budget))
    shape, classes = _shape_and_classes(args)
    net = _model(args.model, shape, classes, args.width)
    shape = shape or net.input_shapes[0]
    if args.max_batch:
        if args.budget is None:
            raise UsageError("--max-batch needs --budget SIZE")
        found = max_batch_size(lambda: _model(args.model, shape, classes, args.width),
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
                  f"{_fmt(out['budget_bytes'])} with memory {spec.spec!r}: "
                  f"{out['max_batch_size']}")
            if found["report"]:
                print_memory_report(found["report"])
        return 0
    try:
        budget = None if args.budget is None else parse_size(args.budget)
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
    try:
        rep = dry_run(net, args.batch_size, spec, args.optimizer, input_shape=shape,
                      plot=args.plot, trace=args.trace, budget=budget)
    except BudgetTooSmall as e:
        from .dryrun import suggest_specs

        print(f"minidl: {e}", file=sys.stderr)
        fits = suggest_specs(lambda: _model(args.model, shape, classes, args.width),
                             args.batch_size, shape, budget or spec.budget, args.optimizer)
        print("  specs that fit: " + (", ".join(
            f"{f['memory']!r} ({_fmt(f['peak_reserved_bytes'])})" for f in fits) or "none"),
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
        if budget is not None:
            print(f"  budget {_fmt(budget)}: the plan "
                  + ("fits" if rep["fits_budget"] else "does NOT fit")
                  + " (peak reserved against the budget)")
        if args.layers:
            from .report import format_layer_table

            if rep["split"] > 1:
                print(f"layers of one micro-batch of {rep['micro_batch_size']} (the batch of "
                      f"{args.batch_size} runs as {rep['split']} micro-batches):")
            print(format_layer_table(rep["layers"]))
        for what, path in (("timeline", args.plot), ("trace", args.trace)):
            if path:
                print(f"{what} saved to {path}")
    return 0 if rep.get("fits_budget", True) else EXIT_OOM


# ------------------------------------------------------------------------------ bench
def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    specs = [_memory(s) for s in args.memory]
    shape, classes = _shape_and_classes(args)
    net0 = _model(args.model, shape, classes, args.width)
    shape = shape or net0.input_shapes[0]
    result = run_bench(  # a partial, not a lambda: PyTorch builds it in its own process
        functools.partial(_model, args.model, shape, classes, args.width), shape, args.batch_size,
        specs, steps=args.steps, warmup=args.warmup, compare_torch=args.compare_torch,
        seed=args.seed, progress=not args.json,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model}, input {'x'.join(map(str, shape))}, batch {args.batch_size}, "
              f"{args.steps} steps per spec (median)")
        print(f"{'memory spec':<36}{'peak allocated':>18}{'step (ms)':>12}{'ratio':>8}")
        for r in result["results"]:
            extra = ""
            if "swap" in r:
                s = r["swap"]
                extra = (f"   offloaded {s['offloaded_bytes']:,} B, stall "
                         f"{1000 * s['stall_s']:.2f} ms, cache hits {s['cache_hits']}")
            if "recompute" in r:
                extra += f"   recomputed {1000 * r['recompute']['time_s']:.1f} ms"
            for b in r.get("bptt", []):
                extra += (f"   {b['layer']}: {b['states_kept']} states, "
                          f"{b['unit_forwards'] / b['units']:.2f} forwards/unit")
            print(f"{r['spec']:<36}{r['peak_allocated_bytes']:>18,}"
                  f"{1000 * r['step_time_median_s']:>12.2f}{r['time_ratio']:>8.3f}{extra}")
        if "torch" in result:
            t = result["torch"]
            print(f"{'pytorch (cpu)':<36}{'':>18}{1000 * t['step_time_median_s']:>12.2f}"
                  f"{t['time_ratio']:>8.3f}   (minidl/torch with {result['results'][0]['spec']})")
    return 0


# ------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(prog="minidl", description=(
        "minidl: train networks larger than device memory, and see where every byte went."))
    p.add_argument("--version", action="version", version=f"minidl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, batch_default: int) -> None:
        sp.add_argument("model", help="smallcnn, lenet5, alexnet, vgg11, vgg16, resnet<N>")
        sp.add_argument("--input", help="per-sample input shape CxHxW (e.g. 3x32x32)")
        sp.add_argument("--batch-size", type=int, default=batch_default)
        sp.add_argument("--width", type=int, default=None, help="first-stage width of the model")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        sp.add_argument("--seq-len", type=int, default=64, help="sequence length (char models)")

    t = sub.add_parser("train", help="train a model with progress bars and a memory report")
    common(t, 32)
    t.add_argument("--dataset", default="digits",
                   help="digits, mnist, fashion-mnist, idx, synthetic")
    t.add_argument("--data-dir", default=None)
    t.add_argument("--epochs", type=int, default=None,
                   help="passes over the train split (default per dataset: 60 on digits, else 30)")
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.05 for sgd, 1e-3 for adam/adamw)")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="L2 weight decay (default per dataset: 5e-3 on digits, else 5e-4)")
    t.add_argument("--schedule", default="cosine", choices=["cosine", "step", "none"],
                   help="learning-rate schedule over the epochs")
    t.add_argument("--budget", default=None,
                   help="device bytes the auto planner must fit (with --memory auto)")
    t.add_argument("--host-memory", default=None,
                   help="bound on host memory holding swapped tensors (e.g. 2GiB)")
    t.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    t.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    t.add_argument("--device-memory", default="auto",
                   help="device arena size (e.g. 256MiB) or 'auto' (what a dry run needs)")
    t.add_argument("--memory", default="none", help="memory spec, e.g. reuse,inplace")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save", default=None, help="checkpoint path (.npz), written atomically")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="dry run on the meta device: the exact peak, no compute")
    common(pl, 64)
    pl.add_argument("--classes", type=int, default=10)
    pl.add_argument("--vocab", type=int, default=65, help="vocabulary size (char models)")
    pl.add_argument("--memory", default="none")
    pl.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    pl.add_argument("--budget", default=None,
                    help="device bytes the auto planner must fit (with --memory auto)")
    pl.add_argument("--plot", default=None, help="save the timeline of device bytes (PNG)")
    pl.add_argument("--trace", default=None, help="save a Chrome/Perfetto trace (JSON)")
    pl.add_argument("--layers", action="store_true", help="print the per-layer table")
    pl.add_argument("--max-batch", action="store_true",
                    help="find the largest batch that fits --budget (dry runs)")
    pl.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="median step time and peak per memory spec")
    common(b, 64)
    b.add_argument("--classes", type=int, default=10)
    b.add_argument("--vocab", type=int, default=65, help="vocabulary size (char models)")
    b.add_argument("--memory", nargs="+", default=["none"])
    b.add_argument("--steps", type=int, default=20)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--compare-torch", action="store_true")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from .executor import NonFiniteError
    from .memory.pool import DeviceOutOfMemory

    args = build_parser().parse_args(argv)
    try:
        validate_args(args)
        return args.func(args)
    except UsageError as e:
        print(f"minidl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeFailure, NonFiniteError) as e:
        print(f"minidl: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except DeviceOutOfMemory as e:
        print(f"minidl: device out of memory\n{e}", file=sys.stderr)
        fits = getattr(e, "suggestions", None)
        if fits:
            print("memory specs whose dry run fits this device memory:", file=sys.stderr)
            for f in fits:
                print(f"  --memory {f['memory']:<48} peak {_fmt(f['peak_reserved_bytes'])}"
                      + (f", {f['split']} micro-batches" if f["split"] > 1 else ""),
                      file=sys.stderr)
        elif fits is not None:
            print("no memory spec fits this device memory at this batch size: lower the "
                  "batch size or raise --device-memory", file=sys.stderr)
        return EXIT_OOM


if __name__ == "__main__":
    sys.exit(main())
