"""The ``minidl`` command: parses ``train``, ``plan`` and ``bench`` command lines, checks every
flag, runs the command (:mod:`minidl.commands`) and turns its errors into exit codes."""

from __future__ import annotations

import argparse
import math
import sys

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
from .commands.plan import cmd_plan
from .commands.show_memory import cmd_show_memory
from .commands.train import cmd_train
from .executor import NonFiniteError
from .memory.pool import DeviceOutOfMemory

EMULATE_LINK_HELP = (
    "throttle the cpu device's copy engine so that copy time / compute time is this GPU's "
    "(v100, titanx-maxwell, ... or custom:flops=,hbm=,link=,mem=) and plan with its costs")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one ``minidl: error: ...`` line (exit 2)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"minidl: error: {message} (see '{self.prog} --help')\n")


def validate_args(args: argparse.Namespace) -> None:
    """Every number and size on the command line, checked before any work starts: one
    :class:`UsageError` naming the flag, the bad value and what is valid."""
    if not hasattr(args, "model"):
        return  # show-memory checks its own
    if args.model is not None:  # plan --compressed FILE takes its model from the file
        check_model_name(args.model)

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
    for spec in specs:
        parse_memory(spec)
    if getattr(args, "plot", None):
        check_plot_path("--plot", args.plot)
    if getattr(args, "emulate_link", None) is not None:
        emulated_target(args.emulate_link, getattr(args, "device", "cpu"))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="minidl", description=(
        "minidl: train networks larger than device memory, and see where every byte went."))
    p.add_argument("--version", action="version", version=f"minidl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, batch_default: int, model_required: bool = True) -> None:
        sp.add_argument("model", nargs=None if model_required else "?",
                        help="smallcnn, lenet5, alexnet, vgg11, vgg16, resnet<N>, "
                             "char-lstm, char-gru, gpt-char, gpt2-small, bert-base")
        sp.add_argument("--input", help="per-sample input shape CxHxW (e.g. 3x32x32)")
        sp.add_argument("--batch-size", type=int, default=batch_default)
        sp.add_argument("--width", type=int, default=None, help="first-stage width of the model")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        sp.add_argument("--seq-len", type=int, default=None,
                        help="sequence length of the text models (default: a transformer's "
                             "context, 64 for the char RNNs); a transformer's context follows it")

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
    t.add_argument("--optimizer", default=None, choices=["sgd", "adam", "adamw"],
                   help="default: adamw for the transformers, sgd for the others")
    t.add_argument("--device", default="cpu", type=device_name,
                   help="cpu (default), cuda or cuda:N (needs the cuda extra and a GPU); "
                        "cuda-strict runs the CUDA code path on the CPU with every array call "
                        "checked against CuPy (for tests)")
    t.add_argument("--device-memory", default="auto",
                   help="device arena size (e.g. 256MiB) or 'auto' (what a dry run needs)")
    t.add_argument("--memory", default="none", help="memory spec, e.g. reuse,inplace")
    t.add_argument("--seed", type=int, default=0)
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
                   help="also log (and, when not on a terminal, print) a line every N steps")
    t.add_argument("--val-every", type=int, default=None, metavar="N",
                   help="evaluate on the test split every N epochs (val_loss, val_accuracy); "
                        "the text models: the validation loss every N steps")
    t.add_argument("--early-stopping", type=int, default=None, metavar="PATIENCE",
                   help="stop once val_loss has not improved for PATIENCE epochs (validates "
                        "every epoch unless --val-every says otherwise)")
    t.add_argument("--trace", default=None, metavar="FILE.json",
                   help="record the run's memory: Chrome / Perfetto trace of the iteration with "
                        "the highest peak (bytes by category, compute and copy threads)")
    t.add_argument("--plot", default=None, metavar="FILE.png",
                   help="record the run's memory: timeline of device bytes with the peak and "
                        "the budget (needs the plot extra)")
    t.add_argument("--snapshot", default=None, metavar="FILE",
                   help="record the run's memory: every event of the iteration with the highest "
                        "peak, for minidl show-memory FILE")
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

    pl = sub.add_parser("plan", help="dry run on the meta device: the exact peak, no compute")
    common(pl, 64, model_required=False)  # not with --compressed FILE
    pl.add_argument("--classes", type=int, default=10)
    pl.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size of the text models (default: the model's, 65 for the "
                         "char RNNs)")
    pl.add_argument("--memory", default="none")
    pl.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="the kind of device to plan for (its layers' workspaces); no GPU needed")
    pl.add_argument("--target", default=None,
                    help="plan for this GPU with its cost model (v100, a100, titanx-maxwell, "
                         "p100, h100, rtx4090, ... or custom:flops=,hbm=,link=,mem=): predicted "
                         "step time and overhead; the budget defaults to its memory")
    pl.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    pl.add_argument("--ranks", type=int, default=1, metavar="N",
                    help="plan one rank of data-parallel training over N ranks (the batch is "
                         "global; with --memory ...,zero=K: ZeRO's sharded bytes per rank)")
    pl.add_argument("--budget", default=None,
                    help="device bytes the auto planner must fit (with --memory auto)")
    pl.add_argument("--plot", default=None,
                    help="save the timeline of device bytes (PNG; with --frontier: the curve)")
    pl.add_argument("--trace", default=None, help="save a Chrome/Perfetto trace (JSON)")
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

    sm = sub.add_parser("show-memory", help="the peak, largest tensors and timeline of a "
                                            "memory snapshot (minidl train --snapshot)")
    sm.add_argument("file", help="a snapshot written by minidl train --snapshot")
    sm.add_argument("--top", type=int, default=10, help="how many of the largest tensors")
    sm.add_argument("--no-timeline", action="store_true", help="leave out the per-step lines")
    sm.add_argument("--plot", default=None, metavar="FILE.png", help="also save the PNG timeline")
    sm.add_argument("--trace", default=None, metavar="FILE.json",
                    help="also save the Chrome / Perfetto trace")
    sm.set_defaults(func=cmd_show_memory)

    b = sub.add_parser("bench", help="median step time and peak per memory spec")
    common(b, 64)
    b.add_argument("--classes", type=int, default=10)
    b.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size of the text models (default: the model's, 65 for the "
                         "char RNNs)")
    b.add_argument("--memory", nargs="+", default=["none"])
    b.add_argument("--steps", type=int, default=20)
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument("--compare-torch", action="store_true")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--emulate-link", default=None, metavar="TARGET", help=EMULATE_LINK_HELP)
    b.add_argument("--device", default="cpu", type=device_name,
                   help="cpu (default), cuda or cuda:N: minidl's steps on that device and, with "
                        "--compare-torch, PyTorch's on the same GPU (each in its own process; "
                        "steps timed to the device's completion)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
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
                print(f"  --memory {f['memory']:<48} peak {format_bytes(f['peak_reserved_bytes'])}"
                      + (f", {f['split']} micro-batches" if f["split"] > 1 else ""),
                      file=sys.stderr)
        elif fits is not None:
            print("no memory spec fits this device memory at this batch size: lower the "
                  "batch size or raise --device-memory", file=sys.stderr)
        return EXIT_OOM


if __name__ == "__main__":
    sys.exit(main())
