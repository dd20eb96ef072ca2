"""The command line of each ``minidl`` subcommand: one function per subcommand's parser
(``compress`` and ``export`` build theirs in their own modules), the options several share
written once."""

from __future__ import annotations

import argparse

from ..datasets import data as D
from ..datasets.text import TEXT_DATASETS
from ..memory.cost.targets import target_names
from ..train.loop.fitting import DEFAULT_BATCH_SIZE
from ..train.loop.language_model import LOG_EVERY_STEPS
from ..zoo.models import default_input_shape
from .bench import cmd_bench
from .common import device_name
from .help_text import (
    EMULATE_LINK_HELP,
    EPILOG,
    MEMORY_HELP,
    SHARED_HELP,
    TEXT_DEFAULT_DATASET,
    lr_defaults,
    model_help,
    per_dataset,
)
from .plan import cmd_plan
from .precision_option import add_precision_argument, precision_checked
from .show_memory import cmd_show_memory
from .train import LOADERS, cmd_train


def add_model_arguments(sp: argparse.ArgumentParser, batch_default: int,
                        model_required: bool = True, input_default: str | None = None) -> None:
    """The model and its input (``train``, ``plan``, ``bench``): MODEL, --input, --batch-size,
    --width, --json and --seq-len."""
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


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``minidl train``: the model, then its data, optimisation, device and memory,
    checkpoints and reports (in that order on its help page)."""
    t = sub.add_parser("train", help="train a model with progress bars and a memory report",
                       epilog=EPILOG)
    add_model_arguments(t, DEFAULT_BATCH_SIZE, input_default=(
        "the dataset's, a folder's first image's; another shape pads or crops the images and "
        "repeats their channel (a folder's are resized); synthetic: the model's own"))
    _train_data_arguments(t)
    _train_optimization_arguments(t)
    _train_device_arguments(t)
    _train_checkpoint_arguments(t)
    _train_report_arguments(t)
    add_precision_argument(t, planned=False)
    t.set_defaults(func=precision_checked(cmd_train))


def _train_data_arguments(t: argparse.ArgumentParser) -> None:
    """``train``'s data: the dataset, where and how it is read, how long."""
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


def _train_optimization_arguments(t: argparse.ArgumentParser) -> None:
    """``train``'s learning rate, weight decay and schedule."""
    t.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default {lr_defaults()})")
    t.add_argument("--weight-decay", type=float, default=None,
                   help="L2 weight decay (default per dataset: "
                        f"{per_dataset('weight_decay', lambda v: f'{v:g}')}); the text models: "
                        "0 unless given (decoupled, as AdamW's, with --optimizer adamw)")
    t.add_argument("--schedule", default=None, choices=["cosine", "step", "none"],
                   help="learning-rate schedule over the epochs of the image models (default: "
                        "cosine; the text models keep --lr and refuse another)")
    t.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip the gradients' global L2 norm to X before each optimizer step "
                        "(torch.nn.utils.clip_grad_norm_; default: none, the text models 5)")
    t.add_argument("--accumulate-grad-batches", type=int, default=1, metavar="K",
                   help="sum the gradients of K batches (each loss scaled by 1/K) per "
                        "optimizer step, an epoch's last window stepping with what it has "
                        "(Lightning's accumulate_grad_batches; default 1)")
    t.add_argument("--label-smoothing", type=float, default=None, metavar="X",
                   help="label smoothing of the image models' cross-entropy, in [0, 1) "
                        "(default per dataset: "
                        f"{per_dataset('label_smoothing', lambda v: f'{v:g}')})")


def _train_device_arguments(t: argparse.ArgumentParser) -> None:
    """``train``'s budget, optimizer, device, memory spec and seed."""
    t.add_argument("--budget", default=None, metavar="SIZE",
                   help="with --memory auto: the device bytes the planner must fit, and the "
                        "device arena's size unless --device-memory gives one (refused "
                        "without auto: --device-memory sizes the arena)")
    t.add_argument("--host-memory", default=None,
                   metavar="SIZE",
                   help="bound on host memory holding swapped tensors and offloaded state, "
                        "e.g. 2GiB (default: unbounded)")
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


def _train_checkpoint_arguments(t: argparse.ArgumentParser) -> None:
    """``train``'s checkpoints: save, resume, initial weights."""
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


def _train_report_arguments(t: argparse.ArgumentParser) -> None:
    """``train``'s logs, validation, memory records and display."""
    t.add_argument("--log", default=None, metavar="FILE",
                   help="metric log, one row per epoch (and every --log-every steps): CSV, or "
                        "JSON lines for .jsonl; appended to with --resume")
    t.add_argument("--log-every", type=int, default=None, metavar="N",
                   help="also log (and, when not on a terminal, print) a line every N steps "
                        "(default: per epoch; the text models print every "
                        f"{LOG_EVERY_STEPS} steps)")
    t.add_argument("--val-every", type=int, default=None, metavar="N",
                   help="evaluate on the test split every N epochs (val_loss, val_accuracy; "
                        "default: every epoch; 0 or --no-val: never); the text models: the "
                        "validation loss every N steps")
    t.add_argument("--no-val", action="store_true",
                   help="no validation during training (the test split is still evaluated at "
                        "the end)")
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


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``minidl plan``: a dry run on the meta device."""
    pl = sub.add_parser("plan", help="dry run on the meta device: the exact peak, no compute",
                        epilog=EPILOG)
    add_model_arguments(pl, DEFAULT_BATCH_SIZE, model_required=False)  # (not with --compressed)
    pl.add_argument("--classes", type=int, default=10, help=SHARED_HELP["classes"])
    pl.add_argument("--host-memory", default=None, metavar="SIZE",
                    help="host bytes the run may use (offloaded state and swap buffers), e.g. "
                         "512GiB: a plan needing more is refused (default: unbounded)")
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
    add_precision_argument(pl, planned=True)
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
    pl.add_argument("--inference", "--eval", action="store_true",
                    help="plan an inference pass (eval mode, no backward, in --precision) "
                         "instead of a training step")
    pl.add_argument("--compressed", default=None, metavar="FILE",
                    help="with --inference: the model of a minidl compress file, its weights "
                         "decoded layer by layer into device memory")
    pl.set_defaults(func=cmd_plan)


def add_show_memory_parser(sub: argparse._SubParsersAction) -> None:
    """``minidl show-memory``: a memory snapshot read back."""
    sm = sub.add_parser("show-memory", help="the peak, largest tensors and timeline of a "
                                            "memory snapshot (minidl train --snapshot)")
    sm.add_argument("file", help="a snapshot written by minidl train --snapshot")
    sm.add_argument("--top", type=int, default=10, help="how many of the largest tensors")
    sm.add_argument("--no-timeline", action="store_true", help="leave out the per-step lines")
    sm.add_argument("--plot", default=None, metavar="FILE.png", help="also save the PNG timeline")
    sm.add_argument("--trace", default=None, metavar="FILE.json",
                    help="also save the Chrome / Perfetto trace")
    sm.set_defaults(func=cmd_show_memory)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """``minidl bench``: median step time and peak per memory spec."""
    b = sub.add_parser("bench", help="median step time and peak per memory spec",
                       epilog=EPILOG)
    add_model_arguments(b, 64)
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
    add_precision_argument(b, planned=False)
    b.set_defaults(func=precision_checked(cmd_bench))
