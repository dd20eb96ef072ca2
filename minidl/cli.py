"""The ``minidl`` command: parses the command line of every subcommand (``train``, ``plan``,
``bench``, ``compress``, ``export``, ``show-memory``, ``memory``), checks every flag, runs the
command (:mod:`minidl.commands`) and turns its errors into exit codes.

The help pages are built from the registries (models, datasets, GPU targets, memory flags and
presets, per-dataset training defaults), so they cannot go stale; every option shows its
default."""

from __future__ import annotations

import argparse
import math
import sys
import textwrap

from . import __version__
from .commands.bench import cmd_bench
from .commands.common import (
    EXIT_FAILURE,
    EXIT_OOM,
    EXIT_USAGE,
    RuntimeFailure,
    UsageError,
    check_model_name,
    check_plot_path,
    device_name,
    emulated_target,
    format_bytes,
    parse_memory,
    parse_size_flag,
)
from .commands.compress import add_parser as add_compress_parser
from .commands.export import add_parser as add_export_parser
from .commands.plan import cmd_plan
from .commands.show_memory import cmd_show_memory
from .commands.train import LOADERS, cmd_train
from .compile.executor import NonFiniteError
from .datasets import data as D
from .datasets.text import TEXT_DATASETS
from .memory.cost.targets import target_names
from .memory.ir.config import FLAGS, PRESETS, MemoryConfig
from .memory.runtime.pool import DeviceOutOfMemory
from .net.optim import make_optimizer
from .settings import Settings
from .zoo.models import MODEL_NAMES, SEQUENCE_MODELS, default_input_shape
from .zoo.rnn import LOG_EVERY_STEPS

EMULATE_LINK_HELP = (
    "throttle the cpu device's copy engine so that copy time / compute time is this GPU's "
    "(v100, titanx-maxwell, ... or custom:flops=,hbm=,link=,mem=) and plan with its costs")

#: ``--dataset``'s default for the text models (the image models' is ``digits``).
TEXT_DEFAULT_DATASET = "shakespeare"

#: Help of options that several subcommands share, for those whose parser gives none.
SHARED_HELP = {
    "batch_size": "samples per step",
    "data_dir": "the folder the dataset is read from: its idx files (idx; fashion-mnist when "
                "not in /usr/share/datasets/fashion-mnist)",
    "no_progress": "no progress display",
    "seed": "random seed",
    "optimizer": "the optimizer",
    "classes": "output classes of the image models",
    "json": "print one JSON object",
}


def model_help() -> str:
    """The MODEL argument's help: every model of :data:`minidl.zoo.models.MODEL_NAMES`."""
    return (f"the model: {', '.join(MODEL_NAMES)} (resnet<N>: any valid depth, e.g. resnet20, "
            "resnet56, resnet1001), or your own as MODULE:FUNCTION (a function returning a "
            "minidl Network; it gets input_shape, num_classes and width if it takes them)")


def per_dataset(field: str, fmt=str) -> str:
    """``minidl train``'s default of ``field`` by dataset, from
    :data:`minidl.datasets.data.TRAIN_DEFAULTS`
    (e.g. "120 on digits, else 30")."""
    base = getattr(D.TrainDefaults(), field)
    special = [f"{fmt(getattr(d, field))} on {name}" for name, d in D.TRAIN_DEFAULTS.items()
               if getattr(d, field) != base]
    return ", ".join([*special, f"else {fmt(base)}"]) if special else fmt(base)


def lr_defaults() -> str:
    """The optimizers' default learning rates (:func:`minidl.net.optim.make_optimizer`)."""
    rates: dict[float, list[str]] = {}
    for name in ("sgd", "adam", "adamw"):
        rates.setdefault(make_optimizer(name, []).lr, []).append(name)
    return ", ".join(f"{lr:g} for {'/'.join(names)}" for lr, names in rates.items())


def _flag_form(name: str) -> str:
    values, _ = FLAGS[name]
    if not values:
        return name
    shown = {"<int>": "K" if name == "split" else "N", "<size>": "SIZE"}
    return f"{name}={'|'.join(shown.get(v, v) for v in values)}"


def memory_help() -> str:
    """The memory spec's page (``minidl memory``, ``--memory help``): every flag of
    :data:`minidl.memory.ir.config.FLAGS` and every preset of ``PRESETS``."""
    forms = {name: _flag_form(name) for name in FLAGS}
    width = max(map(len, [*forms.values(), *PRESETS])) + 2
    wrap = textwrap.TextWrapper(width=100, initial_indent="", subsequent_indent=" " * (width + 2))
    lines = [textwrap.fill("memory spec: flags joined by commas, e.g. --memory reuse,inplace,"
                           "swap=conv (in Python: memory=\"reuse,inplace,swap=conv\"); the "
                           "default is none. Every lossless combination gives bit-identical "
                           "losses and gradients.", 100, break_on_hyphens=False), "", "flags:"]
    for name, (_, what) in FLAGS.items():
        lines.append(wrap.fill(f"  {forms[name]:<{width}}{what}"))
    lines += ["", "presets (usable alone or beside flags):"]
    for name, spec in PRESETS.items():
        lines.append(f"  {name:<{width}}{spec}")
    lines += ["", textwrap.fill(
        "--budget SIZE (train, plan) is auto's budget=SIZE. 'minidl plan MODEL --memory SPEC' "
        "gives a spec's exact peak without running it, 'minidl plan MODEL --memory auto "
        "--frontier' the auto planner's whole curve.", 100)]
    return "\n".join(lines) + "\n"


def cmd_memory(args: argparse.Namespace) -> int:
    print(memory_help(), end="")
    return 0


MEMORY_HELP = "memory spec, e.g. reuse,inplace (minidl memory lists every flag and preset)"
EPILOG = ("memory spec: 'minidl memory' (or --memory help) lists every flag and preset; "
          "'minidl COMMAND --help' every option of a command")


class _Formatter(argparse.HelpFormatter):
    """argparse's help, with each option's default appended where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (action.option_strings and d is not None and d is not False
                and d is not argparse.SUPPRESS and "default" not in text.lower()):
            shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
            text += f" (default: {shown.replace('%', '%%')})"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one ``minidl: error: ...`` line (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"minidl: error: {message} (see '{self.prog} --help')\n")


def _check_budget(args: argparse.Namespace, configs: list[MemoryConfig]) -> None:
    """``--budget``: given once, and (in ``train``) with ``auto``, whose budget it is; ``plan``
    also compares any spec's plan with it."""
    budget = getattr(args, "budget", None)
    if budget is None:
        return
    if any(c.budget is not None for c in configs):
        raise UsageError(f"--budget {budget} and budget= in --memory {args.memory} both give "
                         "the budget: give it once")
    if getattr(args, "command", None) == "train" and not any(c.has("auto") for c in configs):
        raise UsageError(f"--budget {budget} is the auto planner's budget and does nothing with "
                         f"--memory {args.memory}: use --memory auto --budget {budget}, or size "
                         f"the device arena with --device-memory {budget}")


def _note_one_rank(args: argparse.Namespace, configs: list[MemoryConfig]) -> None:
    """``zero=K`` without ``mpiexec``: one line saying that it runs as one rank."""
    if getattr(args, "command", None) not in ("train", "bench") or getattr(args, "quiet", False):
        return
    zero = max((c.zero for c in configs), default=0)
    if not zero or Settings.from_environment().mpi_ranks > 1:
        return
    why = ("bench times one process, so it" if args.command == "bench" else
           "without mpiexec (mpiexec -n N minidl train ... runs N ranks) this")
    print(f"note: zero={zero} shards the training state over data-parallel ranks; {why} runs as "
          "one rank and shards nothing", file=sys.stderr)


def validate_args(args: argparse.Namespace) -> None:
    """Every number and size on the command line, checked before any work starts: one
    :class:`UsageError` naming the flag, the bad value and what is valid."""
    if not hasattr(args, "model"):
        return  # show-memory checks its own
    if args.model is not None:  # plan --compressed FILE takes its model from the file
        check_model_name(args.model)
    if getattr(args, "command", None) == "train" and args.dataset is None:
        args.dataset = TEXT_DEFAULT_DATASET if args.model in SEQUENCE_MODELS else "digits"

    def at_least(flag: str, value, low) -> None:
        if value is not None and not value >= low:  # "not >=" also catches NaN
            raise UsageError(f"{flag} must be >= {low}, got {value}")

    at_least("--batch-size", args.batch_size, 1)
    at_least("--width", args.width, 1)
    at_least("--seq-len", args.seq_len, 1)
    for flag in ("epochs", "max_steps", "classes", "vocab", "steps", "save_every", "log_every",
                 "early_stopping", "val_every"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 1)
    for flag in ("warmup", "seed", "weight_decay"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 0)
    lr = getattr(args, "lr", None)
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr must be a positive finite number, got {lr}")
    parse_size_flag("--budget", getattr(args, "budget", None))
    parse_size_flag("--host-memory", getattr(args, "host_memory", None))
    if getattr(args, "device_memory", "auto") != "auto":
        parse_size_flag("--device-memory", args.device_memory)
    specs = args.memory if isinstance(args.memory, list) else [args.memory]
    configs = [parse_memory(spec) for spec in specs]
    _check_budget(args, configs)
    if getattr(args, "plot", None):
        check_plot_path("--plot", args.plot)
    if getattr(args, "emulate_link", None) is not None:
        emulated_target(args.emulate_link, getattr(args, "device", "cpu"))
    _note_one_rank(args, configs)


def add_memory_files(parser: argparse.ArgumentParser, verb: str, iteration: str) -> None:
    """``--trace`` and ``--snapshot`` (``train``, ``plan``): the memory of ``iteration``
    written as a Chrome / Perfetto trace, and as a snapshot of its every event; each help
    line starts with ``verb``."""
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help=f"{verb}a Chrome / Perfetto trace of {iteration} (bytes by "
                             "category, compute and copy threads)")
    parser.add_argument("--snapshot", default=None, metavar="FILE",
                        help=f"{verb}every memory event of {iteration}, for minidl show-memory "
                             "FILE; FILE.pickle is PyTorch's snapshot format "
                             "(https://pytorch.org/memory_viz, python -m torch.cuda._memory_viz)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="minidl", epilog=EPILOG, description=(
        "minidl: train networks larger than device memory, and see where every byte went."))
    p.add_argument("--version", action="version", version=f"minidl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, batch_default: int, model_required: bool = True,
               input_default: str | None = None) -> None:
        if input_default is None:
            example = "x".join(map(str, default_input_shape("lenet5")))
            input_default = f"the model's own, e.g. {example} for lenet5"
        sp.add_argument("model", nargs=None if model_required else "?", help=model_help())
        sp.add_argument("--input", metavar="CxHxW",
                        help="per-sample input shape CxHxW of the image models, e.g. 3x32x32 "
                             f"(default: {input_default})")
        sp.add_argument("--batch-size", type=int, default=batch_default,
                        help=SHARED_HELP["batch_size"])
        sp.add_argument("--width", type=int, default=None,
                        help="first-stage width of the model (default: the model's own)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        sp.add_argument("--seq-len", type=int, default=None,
                        help="sequence length of the text models (default: a transformer's "
                             "context, 64 for the char RNNs); a transformer's context follows it")

    t = sub.add_parser("train", help="train a model with progress bars and a memory report",
                       epilog=EPILOG)
    common(t, 32, input_default="the dataset's, a folder's first image's; another shape pads or "
                                "crops the images and repeats their channel (a folder's are "
                                "resized); synthetic: the model's own")
    t.add_argument("--dataset", default=None,
                   help=f"image models: {', '.join(D.DATASETS)}; text models: "
                        f"{', '.join(TEXT_DATASETS)} (or synthetic). Default: digits, "
                        f"{TEXT_DEFAULT_DATASET} for the text models")
    t.add_argument("--data-dir", default=None,
                   help=SHARED_HELP["data_dir"] + "; " + "; ".join(
                       f"{what} ({name})" for name, what in D.STREAMABLE.items()))
    t.add_argument("--loader", default="auto", choices=LOADERS,
                   help=f"how the images are read: auto streams {', '.join(D.STREAMABLE)} (batch "
                        "by batch, the next read on a thread) and loads the others in memory; "
                        "memory loads any dataset whole; stream needs one of those")
    t.add_argument("--epochs", type=int, default=None,
                   help="passes over the train split (default per dataset: "
                        f"{per_dataset('epochs')}); the text models run 100 steps per epoch")
    t.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="stop after step N, counted from the run's start (default: the end of "
                        "the epochs)")
    t.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default {lr_defaults()})")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="L2 weight decay (default per dataset: "
                        f"{per_dataset('weight_decay', lambda v: f'{v:g}')}); the text models: "
                        "0 unless given (decoupled, as AdamW's, with --optimizer adamw)")
    t.add_argument("--schedule", default=None, choices=["cosine", "step", "none"],
                   help="learning-rate schedule over the epochs of the image models (default: "
                        "cosine; the text models keep --lr and refuse another)")
    t.add_argument("--budget", default=None, metavar="SIZE",
                   help="with --memory auto: the device bytes the planner must fit, and the "
                        "device arena's size unless --device-memory gives one (refused "
                        "without auto: --device-memory sizes the arena)")
    t.add_argument("--host-memory", default=None,
                   metavar="SIZE",
                   help="bound on host memory holding swapped tensors, e.g. 2GiB (default: "
                        "unbounded)")
    t.add_argument("--optimizer", default=None, choices=["sgd", "adam", "adamw"],
                   help="the optimizer (default: adamw for the transformers, sgd for the "
                        "others)")
    t.add_argument("--device", default="cpu", type=device_name,
                   help="cpu (default), cuda or cuda:N (needs the cuda extra and a GPU); "
                        "cuda-strict runs the CUDA code path on the CPU with every array call "
                        "checked against CuPy (for tests)")
    t.add_argument("--device-memory", default="auto",
                   help="device arena size (e.g. 256MiB) or 'auto' (what a dry run needs)")
    t.add_argument("--memory", default="none", help=MEMORY_HELP)
    t.add_argument("--seed", type=int, default=0,
                   help="random seed: weights, data order, augmentation, train/test split and "
                        "synthetic data")
    t.add_argument("--save", default=None,
                   help="checkpoint path (.npz), written atomically; FILE.safetensors writes the "
                        "weights only (not resumable; needs the io extra)")
    t.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="also write the --save checkpoint every N steps (resumable)")
    t.add_argument("--resume", default=None, metavar="FILE",
                   help="continue the run a --save checkpoint stopped (same flags: model, data, "
                        "optimizer, schedule, epochs); weights, optimizer, schedule, epoch, "
                        "batch and random state are restored, so the result is bit-identical")
    t.add_argument("--init-from", default=None, metavar="FILE.safetensors",
                   help="start a new run from these weights (--save FILE.safetensors, or the "
                        "PyTorch twin's names); names and shapes must match the model")
    t.add_argument("--log", default=None, metavar="FILE",
                   help="metric log, one row per epoch (and every --log-every steps): CSV, or "
                        "JSON lines for .jsonl; appended to with --resume")
    t.add_argument("--log-every", type=int, default=None, metavar="N",
                   help="also log (and, when not on a terminal, print) a line every N steps "
                        "(default: per epoch; the text models print every "
                        f"{LOG_EVERY_STEPS} steps)")
    t.add_argument("--val-every", type=int, default=None, metavar="N",
                   help="evaluate on the test split every N epochs (val_loss, val_accuracy); "
                        "the text models: the validation loss every N steps")
    t.add_argument("--early-stopping", type=int, default=None, metavar="PATIENCE",
                   help="stop once val_loss has not improved for PATIENCE epochs (validates "
                        "every epoch unless --val-every says otherwise)")
    add_memory_files(t, "record the run's memory: ", "the iteration with the highest peak")
    t.add_argument("--plot", default=None, metavar="FILE.png",
                   help="record the run's memory: timeline of device bytes with the peak and "
                        "the budget (needs the plot extra)")
    t.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="TensorBoard scalars (loss, lr, epoch metrics) in DIR (needs "
                        "tensorboardX, or torch with tensorboard)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress display (by default a bar on a terminal, else one line "
                        "per epoch)")
    t.add_argument("--quiet", action="store_true",
                   help="no progress display and no header line: only the results")
    t.add_argument("--emulate-link", default=None, metavar="TARGET", help=EMULATE_LINK_HELP)
    t.add_argument("--sync-bn", action="store_true",
                   help="under mpiexec: BatchNorm normalises with the global batch's statistics "
                        "(default: each rank's shard's)")
    t.set_defaults(func=cmd_train)

    pl = sub.add_parser("plan", help="dry run on the meta device: the exact peak, no compute",
                        epilog=EPILOG)
    common(pl, 64, model_required=False)  # not with --compressed FILE
    pl.add_argument("--classes", type=int, default=10, help=SHARED_HELP["classes"])
    pl.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size of the text models (default: the model's, 65 for the "
                         "char RNNs)")
    pl.add_argument("--memory", default="none", help=MEMORY_HELP)
    pl.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="the kind of device to plan for (its layers' workspaces); no GPU needed")
    pl.add_argument("--target", default=None,
                    help=f"plan for this GPU with its cost model ({', '.join(target_names())} "
                         "or custom:flops=,hbm=,link=,mem=): predicted step time and overhead; "
                         "the budget defaults to its memory (default: this CPU's costs)")
    pl.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                    help="the optimizer whose state the plan holds")
    pl.add_argument("--ranks", default="1", metavar="N[,N...]",
                    help="plan one rank of data-parallel training over N ranks (the batch is "
                         "global; with --memory ...,zero=K: ZeRO's sharded bytes per rank); "
                         "with --table, several counts (1,2,8)")
    pl.add_argument("--table", action="store_true",
                    help="the estimate table: one row per ZeRO stage and --ranks count with one "
                         "rank's parameters, gradients, optimizer state, activations, workspace, "
                         "peak and the largest batch per rank within --budget (or --target's "
                         "memory)")
    pl.add_argument("--budget", default=None, metavar="SIZE",
                    help="device bytes: with --memory auto the planner fits them; any plan is "
                         "checked against them (exit code 1 if it does not fit); --max-batch "
                         "searches under them (default: none, or --target's memory)")
    pl.add_argument("--plot", default=None,
                    help="save the timeline of device bytes (PNG; with --frontier: the curve)")
    add_memory_files(pl, "save ", "the planned iteration")
    pl.add_argument("--layers", action="store_true", help="print the per-layer table")
    pl.add_argument("--max-batch", action="store_true",
                    help="find the largest batch that fits --budget (dry runs; with auto, "
                         "few: a line through the leanest plans' peaks, checked with auto)")
    pl.add_argument("--frontier", action="store_true",
                    help="with --memory auto: print the planner's curve, predicted step time "
                         "against the peak from its least to the unconstrained peak (--plot "
                         "FILE.png draws it)")
    pl.add_argument("--inference", action="store_true",
                    help="plan an inference pass (no backward) instead of a training step")
    pl.add_argument("--compressed", default=None, metavar="FILE",
                    help="with --inference: the model of a minidl compress file, its weights "
                         "decoded layer by layer into device memory")
    pl.set_defaults(func=cmd_plan)

    add_compress_parser(sub)
    add_export_parser(sub)

    sm = sub.add_parser("show-memory", help="the peak, largest tensors and timeline of a "
                                            "memory snapshot (minidl train --snapshot)")
    sm.add_argument("file", help="a snapshot written by minidl train --snapshot")
    sm.add_argument("--top", type=int, default=10, help="how many of the largest tensors")
    sm.add_argument("--no-timeline", action="store_true", help="leave out the per-step lines")
    sm.add_argument("--plot", default=None, metavar="FILE.png", help="also save the PNG timeline")
    sm.add_argument("--trace", default=None, metavar="FILE.json",
                    help="also save the Chrome / Perfetto trace")
    sm.set_defaults(func=cmd_show_memory)

    b = sub.add_parser("bench", help="median step time and peak per memory spec",
                       epilog=EPILOG)
    common(b, 64)
    b.add_argument("--classes", type=int, default=10, help=SHARED_HELP["classes"])
    b.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size of the text models (default: the model's, 65 for the "
                         "char RNNs)")
    b.add_argument("--memory", nargs="+", default=["none"], metavar="SPEC",
                   help="one or more memory specs, each timed (minidl memory lists every flag "
                        "and preset)")
    b.add_argument("--steps", type=int, default=20, help="timed steps per spec (the median is "
                                                         "shown)")
    b.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before them (compilation, caches)")
    b.add_argument("--compare-torch", action="store_true",
                   help="also time PyTorch's step of the same model (needs torch)")
    b.add_argument("--seed", type=int, default=0, help=SHARED_HELP["seed"])
    b.add_argument("--emulate-link", default=None, metavar="TARGET", help=EMULATE_LINK_HELP)
    b.add_argument("--device", default="cpu", type=device_name,
                   help="cpu (default), cuda or cuda:N: minidl's steps on that device and, with "
                        "--compare-torch, PyTorch's on the same GPU (each in its own process; "
                        "steps timed to the device's completion)")
    b.set_defaults(func=cmd_bench)

    m = sub.add_parser("memory", help="the memory spec: every flag and preset (also: --memory "
                                      "help)")
    m.set_defaults(func=cmd_memory)
    _fill_help(sub)
    return p


def _fill_help(sub: argparse._SubParsersAction) -> None:
    """Options a subcommand's parser left without help get the shared one (SHARED_HELP)."""
    for sp in sub.choices.values():
        for action in sp._actions:
            if action.help is None and action.dest in SHARED_HELP:
                action.help = SHARED_HELP[action.dest]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    specs = getattr(args, "memory", None)
    if any(str(s).strip().lower() == "help" for s in (specs if isinstance(specs, list)
                                                       else [specs])):
        return cmd_memory(args)
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
                print(f"  --memory {f['memory']:<48} peak {format_bytes(f['peak_reserved_bytes'])}"
                      + (f", {f['split']} micro-batches" if f["split"] > 1 else ""),
                      file=sys.stderr)
        elif fits is not None:
            print("no memory spec fits this device memory at this batch size: lower the "
                  "batch size or raise --device-memory", file=sys.stderr)
        return EXIT_OOM


if __name__ == "__main__":
    sys.exit(main())
