"""``minidl train``: train a reference model on a dataset and print its memory report."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import numpy as np

from ..analysis.dryrun import auto_device_memory, suggest_specs
from ..datasets import data as D
from ..datasets.loaders import ImageReadError
from ..datasets.text import TEXT_DATASETS, load_text_dataset
from ..interop.checkpoint import check_writable
from ..interop.memory_viz import is_pickle_path, open_hint
from ..interop.safetensors_io import SafetensorsError, load_into, save_safetensors
from ..layers import SoftmaxCrossEntropy
from ..memory.runtime.pool import DeviceOutOfMemory
from ..net.optim import CosineAnnealingLR, StepLR, make_optimizer
from ..train import callbacks as C
from ..train.fitting import ResumeMismatch
from ..train.trainer import CheckpointError, Trainer
from ..zoo.models import SEQUENCE_MODELS, TRANSFORMER_MODELS, default_input_shape
from ..zoo.rnn import train_language_model
from .common import (
    RuntimeFailure,
    UsageError,
    build_model,
    check_device,
    check_plot_path,
    emulated_target,
    format_bytes,
    parse_chw,
    parse_memory,
    print_memory_report,
    require_module,
    resolved_seq_len,
    with_budget,
)
from .distributed import mpi_job, quiet_other_ranks, ranks_stop_together, refuse_for_text

#: --loader: auto streams the datasets read from --data-dir (folder, cifar10, cifar100: images
#: read batch by batch, the next on a background thread) and loads the others in memory.
LOADERS = ("auto", "memory", "stream")


def _is_safetensors(path: str | None) -> bool:
    return bool(path) and path.lower().endswith(".safetensors")


def _save(trainer, path: str) -> None:
    """The --save file: a resumable .npz checkpoint, or the weights only for .safetensors."""
    try:
        if not _is_safetensors(path):
            trainer.save(path)
            return
        meta = {"minidl.model": trainer.net.name, "minidl.iteration": str(trainer.iteration)}
        write = lambda: save_safetensors(trainer.net, path, metadata=meta)  # noqa: E731
        if trainer.parallel is None:
            write()
        else:
            trainer.parallel.root_writes(write)
    except OSError as e:
        raise RuntimeFailure(f"cannot write checkpoint {path}: {e}") from None


def _init_from(net, path: str | None) -> None:
    """--init-from FILE.safetensors: the weights a new run starts from (strict)."""
    if path:
        try:
            load_into(net, path, strict=True)
        except (SafetensorsError, OSError) as e:
            raise UsageError(f"--init-from {path}: {e}") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """The files a run writes and reads, checked before any work starts."""
    if args.save_every is not None and not args.save:
        raise UsageError("--save-every N writes the checkpoint named by --save FILE: add --save")
    for flag in ("save", "log", "trace", "plot", "snapshot"):
        path = getattr(args, flag)
        if path:
            try:
                check_writable(path)
            except OSError as e:
                raise UsageError(f"--{flag} {path}: {e}") from None
    if args.plot:
        check_plot_path("--plot", args.plot)
    if args.resume and not os.path.isfile(args.resume):
        raise UsageError(f"--resume {args.resume}: no such checkpoint file")
    if _is_safetensors(args.save) and args.save_every is not None:
        raise UsageError(f"--save-every N writes resumable checkpoints; {args.save} holds the "
                         "weights only: use --save FILE.npz")
    if _is_safetensors(args.resume):
        raise UsageError(f"--resume {args.resume}: a .safetensors file holds the weights only "
                         "(no optimizer state or position); start a new run from it with "
                         "--init-from")
    if args.init_from:
        if args.resume:
            raise UsageError("--init-from starts a new run from weights; --resume continues "
                             "one: give only one of them")
        if not os.path.isfile(args.init_from):
            raise UsageError(f"--init-from {args.init_from}: no such file")
    if _is_safetensors(args.save):
        require_module("safetensors", "io", f"--save {args.save}")
    if args.init_from:
        require_module("safetensors", "io", "--init-from")


def _refuse_epoch_flags(args: argparse.Namespace) -> None:
    """The text models train on random windows, not epochs: no epoch callbacks (they do take
    --resume, --save-every and --val-every, counted in steps)."""
    used = [f for f in ("log", "early_stopping", "tensorboard")
            if getattr(args, f) is not None]
    if used:
        raise UsageError(f"--{used[0].replace('_', '-')} is for the image models' epochs; "
                         f"{args.model} trains on random windows of text")


def _callbacks(args: argparse.Namespace) -> list:
    """The callbacks the flags ask for: checkpoints every N steps, the metric log, early
    stopping."""
    out: list = []
    if args.save_every is not None:
        out.append(C.ModelCheckpoint(args.save, every_steps=args.save_every))
    if args.log:
        out.append(C.MetricLogger(args.log, every_steps=args.log_every,
                                  append=args.resume is not None))
    if args.early_stopping is not None:
        out.append(C.EarlyStopping("val_loss", patience=args.early_stopping))
    if args.tensorboard:
        try:
            out.append(C.TensorBoard(args.tensorboard))
        except ImportError as e:
            raise RuntimeFailure(f"--tensorboard: {e}") from None
    return out


def _note_save_every(args: argparse.Namespace, trainer: Trainer, steps_per_epoch: int) -> None:
    """Say so when ``--save-every N`` cannot fire in this run (N past its last step)."""
    total = steps_per_epoch * args.epochs
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    if args.save_every is None or args.save_every <= total or args.json or args.quiet:
        return
    print(f"note: --save-every {args.save_every} is past this run's last step ({total}: "
          f"{args.epochs} epochs of {steps_per_epoch} steps"
          + (f", --max-steps {args.max_steps}" if args.max_steps is not None else "")
          + f"): only the final checkpoint is written, to {args.save}", file=sys.stderr)


@contextlib.contextmanager
def _recorded(trainer: Trainer, args: argparse.Namespace):
    """With --trace / --plot / --snapshot: record the run's memory and write those files."""
    if not (args.trace or args.plot or args.snapshot):
        yield
        return
    with trainer.record_memory() as rec:
        yield
    try:
        if args.snapshot:
            rec.save_snapshot(args.snapshot)
        if args.trace:
            rec.save_trace(args.trace)
        if args.plot:
            rec.save_plot(args.plot)
    except OSError as e:
        raise RuntimeFailure(f"cannot write {e.filename}: {e.strerror}") from None
    out = sys.stderr if args.json else sys.stdout
    opened = {"trace": " (open it in https://ui.perfetto.dev)", "timeline": "",
              "memory snapshot": f" (minidl show-memory {args.snapshot})"}
    if args.snapshot and is_pickle_path(args.snapshot):  # PyTorch's format
        opened["memory snapshot"] = (f" in PyTorch's format: {open_hint(args.snapshot)}; "
                                     f"minidl show-memory {args.snapshot} reads it too")
    for what, path in (("memory snapshot", args.snapshot), ("trace", args.trace),
                       ("timeline", args.plot)):
        if path:
            print(f"{what} of iteration {rec.snapshot()['iteration']} (the highest peak) saved "
                  f"to {path}{opened[what]}", file=out)


def _saver(trainer: Trainer, path: str | None, every: int | None):
    """``on_step`` of the text models' loop: a checkpoint every ``every`` steps (or None)."""
    if not every:
        return None
    return lambda k: _save(trainer, path) if k % every == 0 else None


def _resume(trainer: Trainer, path: str) -> None:
    try:
        trainer.load(path, resume=True)
    except (CheckpointError, OSError) as e:
        raise UsageError(f"--resume {path}: {e}") from None


def _emulate_link(args: argparse.Namespace):
    """``--emulate-link``: the target's profile (or ``None``)."""
    if args.emulate_link is None:
        return None
    return emulated_target(args.emulate_link, args.device)


def _print_link(rep: dict) -> None:
    """The emulated link's line of the report (``--emulate-link``)."""
    link = rep.get("link_emulation")
    if link and link["slowdown"] is not None:
        stall = rep.get("swap", {}).get("stall_s")
        print(f"emulated {link['target']} link: this CPU computes {link['slowdown']:.0f}x "
              f"slower than a {link['target']}, so copies were throttled to "
              f"{link['link_bytes_per_s'] / 1e6:.1f} MB/s ({link['target']}: "
              f"{link['target_link_bytes_per_s'] / 1e9:.1f} GB/s)"
              + ("" if stall is None else f"; last step's stall {1000 * stall:.2f} ms"))


def cmd_train_text(args: argparse.Namespace, spec) -> int:
    """Character-level language model on Shakespeare (or synthetic text)."""
    _refuse_epoch_flags(args)
    name = "synthetic-text" if args.dataset == "synthetic" else args.dataset
    if name not in TEXT_DATASETS:
        raise UsageError(f"unknown dataset {args.dataset!r} for {args.model}; valid: "
                         f"{', '.join(TEXT_DATASETS)}")
    try:
        ds = load_text_dataset(name)
    except (ImportError, OSError, ValueError) as e:
        raise RuntimeFailure(f"cannot load dataset {name!r}: {e}") from None
    args.seq_len = resolved_seq_len(args)
    net = build_model(args.model, (args.seq_len,), ds.vocab_size, args.width)
    _init_from(net, args.init_from)
    opt = make_optimizer(args.optimizer, net.parameters(), args.lr, args.weight_decay)
    device_memory = args.device_memory
    link = _emulate_link(args)
    if device_memory == "auto":
        device_memory = spec.budget or auto_device_memory(
            net, args.batch_size, spec, args.optimizer, (args.seq_len,),
            device_kind="cuda" if args.device.startswith("cuda") else "cpu", emulate_link=link)
    trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                      seed=args.seed, clip_grad_norm=5.0, host_memory=args.host_memory,
                      emulate_link=link)
    steps = args.max_steps or max(1, args.epochs) * 100
    if args.resume:
        _resume(trainer, args.resume)
        if trainer.iteration >= steps:
            raise UsageError(f"--resume {args.resume}: the run is already at step "
                             f"{trainer.iteration} of {steps} (raise --max-steps to train "
                             "further)")
    if not (args.json or args.quiet):
        print(f"training {net.name} ({net.num_parameters():,} parameters) on {ds.name}: "
              f"{len(ds.train):,} train / {len(ds.val):,} validation characters, vocabulary "
              f"{ds.vocab_size}, seq-len {args.seq_len}, batch {args.batch_size}, {steps} steps, "
              f"memory {spec.spec!r}", file=sys.stderr)
    with _recorded(trainer, args):
        res = train_language_model(trainer, ds, args.batch_size, args.seq_len, steps,
                                   progress=not args.no_progress, seed=args.seed,
                                   progress_every=args.log_every,
                                   on_step=_saver(trainer, args.save, args.save_every),
                                   val_every=args.val_every)
    if args.save:
        _save(trainer, args.save)
        if not (args.json or args.quiet) and (trainer.parallel is None
                                              or trainer.parallel.comm.rank == 0):
            print(f"checkpoint saved to {os.path.abspath(args.save)} (step "
                  f"{trainer.iteration}{'' if _is_safetensors(args.save) else ', resumable'})",
                  file=sys.stderr)
    rep = trainer.memory_report()
    result = {"model": args.model, "dataset": ds.name, "memory": spec.spec,
              "losses": res["losses"], "final_loss": res["losses"][-1],
              "val_loss": res["val_loss"], "val_perplexity": res["val_perplexity"],
              "val_history": res["val_history"],
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
        _print_link(rep)
        print_memory_report(rep)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    defaults = D.train_defaults(args.dataset)
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
    spec = parse_memory(with_budget(args.memory, args.budget))
    check_device(args.device)
    _check_outputs(args)
    comm = mpi_job()  # under mpiexec -n N (N > 1): data-parallel, rank 0 prints and writes
    quiet_other_ranks(args, comm)
    if args.quiet:
        args.no_progress = True
    if args.model in SEQUENCE_MODELS:
        refuse_for_text(args, comm)
        return cmd_train_text(args, spec)
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
    input_shape = parse_chw(args.input)
    if args.dataset == "synthetic" and input_shape is None:
        input_shape = default_input_shape(args.model)
    try:
        ds = D.load_dataset(args.dataset, data_dir=args.data_dir, input_shape=input_shape,
                            seed=args.seed, lazy=loader != "memory", progress=not args.quiet)
    except (ImportError, OSError, ValueError) as e:
        raise RuntimeFailure(f"cannot load dataset {args.dataset!r}: {e}") from None
    if defaults.standardize:
        ds.standardize()
    net = build_model(args.model, ds.input_shape, ds.num_classes, args.width)
    _init_from(net, args.init_from)
    try:
        opt = make_optimizer(args.optimizer, net.parameters(), args.lr, args.weight_decay)
    except ValueError as e:
        raise UsageError(str(e)) from None
    scheduler = None
    if args.schedule == "cosine":
        scheduler = CosineAnnealingLR(opt, T_max=args.epochs)
    elif args.schedule == "step":
        scheduler = StepLR(opt, step_size=max(1, args.epochs // 3))
    device_memory = args.device_memory
    link = _emulate_link(args)
    if device_memory == "auto" and spec.budget is not None:
        device_memory = spec.budget
    elif device_memory == "auto":
        device_memory = auto_device_memory(
            net, args.batch_size, spec, args.optimizer, ds.input_shape,
            device_kind="cuda" if args.device.startswith("cuda") else "cpu", emulate_link=link)
    try:
        trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                          seed=args.seed, scheduler=scheduler, host_memory=args.host_memory,
                          loss=SoftmaxCrossEntropy(label_smoothing=defaults.label_smoothing),
                          emulate_link=link, comm=comm, sync_bn=args.sync_bn)
    except RuntimeError as e:  # the cuda device without a GPU
        raise RuntimeFailure(str(e)) from None
    except ValueError as e:  # ranks of an mpiexec job that disagree (model, spec, ...)
        raise UsageError(str(e)) from None
    trainer.announce_compilation = not args.quiet
    if args.resume:
        _resume(trainer, args.resume)
    augment = None
    if defaults.shift_probability > 0:
        augment = functools.partial(D.random_shift, probability=defaults.shift_probability,
                                    fill=ds.background)
    if not (args.json or args.quiet):
        print(f"training {net.name} ({net.num_parameters():,} parameters) on {ds.name}: "
              f"{len(ds.x_train)} train / {len(ds.x_test)} test samples, input "
              f"{'x'.join(map(str, ds.input_shape))}"
              f"{f' ({ds.adaptation()})' if ds.adaptation() else ''}"
              f"{' (standardised with the train mean/std)' if ds.mean is not None else ''}"
              f"{f', {defaults.shift_probability:.0%} shifted by 1 px' if augment else ''}, "
              f"{args.epochs} epochs of batch {args.batch_size}, memory "
              f"{spec.spec!r}, {trainer.device.name} device with "
              f"{format_bytes(trainer.device.capacity)}"
              + (f"; data-parallel over {comm.size} MPI ranks" if comm else ""),
              file=sys.stderr)
    _note_save_every(args, trainer, -(-len(ds.x_train) // args.batch_size))
    t0 = time.perf_counter()
    try:
        with ranks_stop_together(comm), _recorded(trainer, args):
            hist = trainer.fit(ds, epochs=args.epochs, batch_size=args.batch_size,
                               max_steps=args.max_steps, progress=not args.no_progress,
                               augment=augment, callbacks=_callbacks(args),
                               val_every=args.val_every if args.val_every is not None else (
                                   1 if args.early_stopping is not None else None),
                               progress_every=args.log_every)
    except ResumeMismatch as e:
        raise UsageError(f"--resume {args.resume}: {e}") from None
    except ImageReadError as e:  # (a streamed image, read when its batch came)
        raise RuntimeFailure(str(e)) from None
    except DeviceOutOfMemory as e:
        fits = suggest_specs(lambda: build_model(args.model, ds.input_shape, ds.num_classes,
                                            args.width), args.batch_size, ds.input_shape,
                             trainer.device.capacity, args.optimizer)
        e.suggestions = fits
        raise
    wall = time.perf_counter() - t0
    unchanged = bool(args.resume and not hist.losses and args.save
                     and os.path.abspath(args.save) == os.path.abspath(args.resume))
    if args.save and not unchanged:  # (a resumed run that trained nothing leaves its file)
        _save(trainer, args.save)
        if not (args.json or args.quiet) and (trainer.parallel is None
                                              or trainer.parallel.comm.rank == 0):
            print(f"checkpoint saved to {os.path.abspath(args.save)} (step "
                  f"{trainer.iteration}{'' if _is_safetensors(args.save) else ', resumable'})",
                  file=sys.stderr)
    if comm is not None and comm.rank != 0:
        return 0
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
        "iteration": trainer.iteration,
        "epochs": args.epochs,
        "epoch_logs": hist.epochs,
        "stopped_early": hist.stopped_early,
        "weight_decay": args.weight_decay,
        "input_mean": ds.mean,
        "input_std": ds.std,
        "label_smoothing": defaults.label_smoothing,
        "ranks": 1 if comm is None else comm.size,
        "shift_probability": defaults.shift_probability,
        "memory_report": rep,
    }
    if args.json:
        print(json.dumps(result))
    else:
        if hist.losses:
            print(f"steps: {len(hist.losses)}, final training loss {result['final_loss']:.4f}, "
                  f"median step {1000 * (result['step_time_median_s'] or 0):.1f} ms, "
                  f"wall time {wall:.1f} s")
        elif hist.stopped_early:
            print(f"nothing to train: the run had stopped early at epoch {trainer.epoch} of "
                  f"{args.epochs} (step {trainer.iteration})")
        else:
            print(f"nothing to train: the run already stands at epoch {trainer.epoch} of "
                  f"{args.epochs} (step {trainer.iteration})")
        if hist.stopped_early and hist.losses and args.no_progress:
            print(hist.stop_reason)  # (else the progress display said it)
        if hist.test_accuracy is not None:
            print(f"test loss {hist.test_loss:.4f}, test accuracy {100 * hist.test_accuracy:.2f}%")
        _print_link(rep)
        print_memory_report(rep)
    return 0
