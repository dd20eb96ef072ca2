"""The options of ``minidl train``: completed from the model and the dataset's defaults, and
checked (the files a run reads and writes, the data it loads) before any work starts."""

from __future__ import annotations

import argparse
import os

from ..datasets import data as D
from ..zoo.models import SEQUENCE_MODELS, TRANSFORMER_MODELS
from .common import UsageError, check_output_paths, check_plot_path, require_module

#: --loader: auto streams the datasets read from --data-dir (folder, cifar10, cifar100: images
#: read batch by batch, the next on a background thread) and loads the others in memory.
LOADERS = ("auto", "memory", "stream")


#: What ``--save FILE`` writes, by FILE's suffix.
SAVE_SUFFIXES = {".npz": "a resumable checkpoint", ".safetensors": "the weights only"}


def is_safetensors(path: str | None) -> bool:
    """Whether ``path`` names a .safetensors file (the weights only, not resumable)."""
    return bool(path) and path.lower().endswith(".safetensors")


def complete_options(args: argparse.Namespace, defaults: D.TrainDefaults) -> None:
    """The options left out, from the model and the dataset's training defaults; the text
    models refuse a schedule."""
    if args.optimizer is None:
        args.optimizer = "adamw" if args.model in TRANSFORMER_MODELS else "sgd"
    if args.epochs is None:
        args.epochs = defaults.epochs
    if args.model in SEQUENCE_MODELS:  # (no epochs to schedule; weight decay only if asked)
        if args.schedule not in (None, "none"):
            raise UsageError(f"--schedule {args.schedule}: the text models train a number of "
                             "steps at a constant --lr (no epochs to schedule over)")
        if args.weight_decay is None:
            args.weight_decay = 0.0
    args.schedule = args.schedule or "cosine"
    if args.weight_decay is None:
        args.weight_decay = defaults.weight_decay
    check_gradient_options(args, defaults)


def check_gradient_options(args: argparse.Namespace, defaults: D.TrainDefaults) -> None:
    """--clip-grad-norm, --accumulate-grad-batches, --label-smoothing and --no-val checked
    (one line naming the value and what is valid); label smoothing completed from the
    dataset's default."""
    if args.clip_grad_norm is not None and not (args.clip_grad_norm > 0
                                                and args.clip_grad_norm < float("inf")):
        raise UsageError(f"--clip-grad-norm {args.clip_grad_norm:g}: give the largest global "
                         "L2 norm of the gradients, a number > 0")
    if args.accumulate_grad_batches < 1:
        raise UsageError(f"--accumulate-grad-batches {args.accumulate_grad_batches}: give the "
                         "number of batches per optimizer step, a whole number >= 1")
    k = args.accumulate_grad_batches
    if k > 1 and args.save_every is not None and args.save_every % k:
        raise UsageError(f"--save-every {args.save_every} with --accumulate-grad-batches {k}: "
                         "a checkpoint mid-window would drop the gradients summed so far; give "
                         f"a multiple of {k}")
    if args.no_val and (args.val_every is not None or args.early_stopping is not None):
        raise UsageError("--no-val turns validation off; --val-every and --early-stopping need "
                         "it: give only one of them")
    if args.model in SEQUENCE_MODELS:
        if args.label_smoothing is not None:
            raise UsageError("--label-smoothing is for the image models' classes; "
                             f"{args.model} predicts characters without it")
        if k > 1:
            raise UsageError(f"--accumulate-grad-batches is for the image models; {args.model} "
                             "trains on random windows: raise --batch-size instead")
        if args.no_val:
            raise UsageError("--no-val is for the image models' epochs; the text models "
                             "validate at the end of the run (and every --val-every steps)")
        return
    if args.label_smoothing is None:
        args.label_smoothing = defaults.label_smoothing
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label-smoothing {args.label_smoothing:g}: give a number in [0, 1) "
                         "(0: none)")


def check_outputs(args: argparse.Namespace) -> None:
    """The files a run writes and reads, checked before any work starts."""
    if args.save_every is not None and not args.save:
        raise UsageError("--save-every N writes the checkpoint named by --save FILE: add --save")
    check_output_paths(args)  # (also done by minidl.cli before any command: train's own)
    suffix = os.path.splitext(args.save or "")[1].lower()
    if args.save and suffix not in SAVE_SUFFIXES:
        raise UsageError(f"--save {args.save}: "
                         + (f"'{suffix}' is not a checkpoint format" if suffix else "no suffix")
                         + "; valid: " + ", ".join(f"{k} ({v})" for k, v in SAVE_SUFFIXES.items()))
    if args.plot:
        check_plot_path("--plot", args.plot)
    if args.resume and not os.path.isfile(args.resume):
        raise UsageError(f"--resume {args.resume}: no such checkpoint file")
    if is_safetensors(args.save) and args.save_every is not None:
        raise UsageError(f"--save-every N writes resumable checkpoints; {args.save} holds the "
                         "weights only: use --save FILE.npz")
    if is_safetensors(args.resume):
        raise UsageError(f"--resume {args.resume}: a .safetensors file holds the weights only "
                         "(no optimizer state or position); start a new run from it with "
                         "--init-from")
    if args.init_from:
        if args.resume:
            raise UsageError("--init-from starts a new run from weights; --resume continues "
                             "one: give only one of them")
        if not os.path.isfile(args.init_from):
            raise UsageError(f"--init-from {args.init_from}: no such file")
    if is_safetensors(args.save):
        require_module("safetensors", "io", f"--save {args.save}")
    if args.init_from:
        require_module("safetensors", "io", "--init-from")


def refuse_epoch_flags(args: argparse.Namespace) -> None:
    """The text models train on random windows, not epochs: no epoch callbacks (they do take
    --resume, --save-every and --val-every, counted in steps)."""
    used = [f for f in ("log", "early_stopping", "tensorboard")
            if getattr(args, f) is not None]
    if used:
        raise UsageError(f"--{used[0].replace('_', '-')} is for the image models' epochs; "
                         f"{args.model} trains on random windows of text")


def image_loader(args: argparse.Namespace) -> str:
    """``--loader`` (``auto`` when left out), checked with ``--dataset`` and ``--data-dir``."""
    if args.dataset not in D.DATASETS:
        raise UsageError(D.unknown_dataset(args.dataset))
    if args.dataset == "idx" and args.data_dir is None:
        raise UsageError("--dataset idx needs --data-dir DIR, a folder of MNIST-format idx files "
                         "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-...)")
    if args.dataset in D.STREAMABLE and args.data_dir is None:
        raise UsageError(f"--dataset {args.dataset} needs --data-dir DIR: "
                         f"{D.STREAMABLE[args.dataset]}")
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        raise UsageError(f"--data-dir {args.data_dir}: no such folder")
    loader = getattr(args, "loader", None) or "auto"  # stream: read batch by batch, prefetched
    if loader not in LOADERS:
        raise UsageError(f"unknown --loader {loader!r}; valid: {', '.join(LOADERS)}")
    if loader == "stream" and args.dataset not in D.STREAMABLE:
        raise UsageError(f"--loader stream reads {', '.join(D.STREAMABLE)} batch by batch; "
                         f"{args.dataset} is loaded in memory: leave --loader out")
    return loader
