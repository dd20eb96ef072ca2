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
from ..datasets.image_sources import ImageReadError
from ..datasets.text import TEXT_DATASETS, load_text_dataset
from ..interop.memory_viz import is_pickle_path, open_hint
from ..interop.safetensors_io import SafetensorsError, load_into, save_safetensors
from ..layers import SoftmaxCrossEntropy
from ..memory.runtime.pool import DeviceOutOfMemory
from ..net.optim import CosineAnnealingLR, StepLR, make_optimizer
from ..train import callbacks as C
from ..train.loop.fitting import ResumeMismatch
from ..train.loop.language_model import train_language_model
from ..train.trainer import CheckpointError, Trainer
from ..zoo.models import SEQUENCE_MODELS, default_input_shape
from .common import (
    RuntimeFailure,
    UsageError,
    build_model,
    check_device,
    emulated_target,
    format_bytes,
    parse_chw,
    parse_memory,
    resolved_seq_len,
    with_budget,
)
from .distributed import mpi_job, quiet_other_ranks, ranks_stop_together, refuse_for_text
from .interrupt import StepBoundaryInterrupt, StopOnCtrlC, report_interrupt
from .train_options import (
    LOADERS,
    check_outputs,
    complete_options,
    image_loader,
    is_safetensors,
    refuse_epoch_flags,
)
from .train_report import image_result, precision_entries, print_image_report, print_text_report

__all__ = ["LOADERS", "cmd_train", "cmd_train_text"]  # (LOADERS: cli.py reads it here)


def _save(trainer, path: str) -> None:
    """The --save file: a resumable .npz checkpoint, or the weights only for .safetensors."""
    try:
        if not is_safetensors(path):
            trainer.save(path)
            return
        meta = {"minidl.model": trainer.net.name, "minidl.iteration": str(trainer.iteration)}
        write = lambda: save_safetensors(trainer.net, path, metadata=meta)  # noqa: E731
        if trainer.parallel is None:
            write()
        else:
            trainer.parallel.root_writes(write)
    except OSError as e:
        raise RuntimeFailure(f"cannot write checkpoint {path}: {e.strerror or e}") from None


def _save_final(args: argparse.Namespace, trainer: Trainer) -> None:
    """The run's last checkpoint to ``--save``, said on stderr (by rank 0)."""
    _save(trainer, args.save)
    if not (args.json or args.quiet) and (trainer.parallel is None
                                          or trainer.parallel.comm.rank == 0):
        print(f"checkpoint saved to {os.path.abspath(args.save)} (step "
              f"{trainer.iteration}{'' if is_safetensors(args.save) else ', resumable'})",
              file=sys.stderr)


def _init_from(net, path: str | None) -> None:
    """--init-from FILE.safetensors: the weights a new run starts from (strict)."""
    if path:
        try:
            load_into(net, path, strict=True)
        except (SafetensorsError, OSError) as e:
            raise UsageError(f"--init-from {path}: {e}") from None


def _callbacks(args: argparse.Namespace) -> list:
    """The callbacks the flags ask for: checkpoints every N steps, the metric log, early
    stopping."""
    out: list = []
    if args.save_every is not None:
        out.append(C.ModelCheckpoint(args.save, every_n_train_steps=args.save_every))
    if args.log:
        out.append(C.MetricLogger(args.log, log_every_n_steps=args.log_every,
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
    return None if args.emulate_link is None else emulated_target(args.emulate_link, args.device)




def _auto_memory(args: argparse.Namespace, net, spec, input_shape, link) -> int:
    """``--device-memory auto``: the dry runs' need in the run's precision."""
    return auto_device_memory(net, args.batch_size, spec, args.optimizer, input_shape,
                              device_kind="cuda" if args.device.startswith("cuda") else "cpu",
                              emulate_link=link, precision=args.precision)


def cmd_train_text(args: argparse.Namespace, spec) -> int:
    """Character-level language model on Shakespeare (or synthetic text)."""
    refuse_epoch_flags(args)
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
        device_memory = spec.budget or _auto_memory(args, net, spec, (args.seq_len,), link)
    trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                      seed=args.seed, host_memory=args.host_memory,
                      clip_grad_norm=5.0 if args.clip_grad_norm is None else args.clip_grad_norm,
                      emulate_link=link, precision=args.precision)
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
    saver = _saver(trainer, args.save, args.save_every)
    stop = StopOnCtrlC()

    def after_step(k: int) -> None:
        if saver is not None:
            saver(k)
        stop.check()

    try:
        with stop, _recorded(trainer, args):
            res = train_language_model(trainer, ds, args.batch_size, args.seq_len, steps,
                                       progress=not args.no_progress, seed=args.seed,
                                       progress_every=args.log_every, on_step=after_step,
                                       val_every=args.val_every)
    except KeyboardInterrupt as e:
        return report_interrupt(args, trainer, isinstance(e, StepBoundaryInterrupt), [], _save,
                                steps=steps)
    if args.save:
        _save_final(args, trainer)
    rep = trainer.memory_report()
    result = {"model": args.model, "dataset": ds.name, "memory": spec.spec,
              "losses": res["losses"], "final_loss": res["losses"][-1],
              "val_loss": res["val_loss"], "val_perplexity": res["val_perplexity"],
              "val_history": res["val_history"],
              "peak_allocated_bytes": rep["peak_allocated_bytes"],
              "peak_reserved_bytes": rep["peak_reserved_bytes"],
              "step_time_median_s": float(np.median(res["step_times"])),
              "wall_time_s": res["wall_time_s"], "steps": steps, "memory_report": rep,
              **precision_entries(trainer)}
    if args.json:
        print(json.dumps(result))
    else:
        print_text_report(steps, res, result, rep)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """``minidl train``: the options completed and checked, the data loaded, the model and its
    Trainer built, the run, then its report (rank 0's, under mpiexec)."""
    defaults = D.train_defaults(args.dataset)
    complete_options(args, defaults)
    spec = parse_memory(with_budget(args.memory, args.budget))
    check_device(args.device)
    check_outputs(args)
    comm = mpi_job()  # under mpiexec -n N (N > 1): data-parallel, rank 0 prints and writes
    quiet_other_ranks(args, comm)
    if args.quiet:
        args.no_progress = True
    if args.model in SEQUENCE_MODELS:
        refuse_for_text(args, comm)
        return cmd_train_text(args, spec)
    ds = _load_images(args, defaults, image_loader(args))
    trainer = _image_trainer(args, spec, ds, defaults, comm)
    augment = None
    if defaults.shift_probability > 0:
        augment = functools.partial(D.random_shift, probability=defaults.shift_probability,
                                    fill=ds.background)
    if not (args.json or args.quiet):
        _print_header(args, spec, ds, trainer, defaults, augment is not None, comm)
    _note_save_every(args, trainer, -(-len(ds.x_train) // args.batch_size))
    callbacks = _callbacks(args)
    stop = StopOnCtrlC(enabled=comm is None)  # (an mpiexec job's ranks stop together)
    t0 = time.perf_counter()
    try:
        with stop:
            hist = _fit(args, trainer, ds, augment, comm, [*callbacks, stop])
    except KeyboardInterrupt as e:
        return report_interrupt(args, trainer, isinstance(e, StepBoundaryInterrupt), callbacks,
                                _save)
    wall = time.perf_counter() - t0
    unchanged = bool(args.resume and not hist.losses and args.save
                     and os.path.abspath(args.save) == os.path.abspath(args.resume))
    if args.save and not unchanged:  # (a resumed run that trained nothing leaves its file)
        _save_final(args, trainer)
    if comm is not None and comm.rank != 0:
        return 0
    rep = trainer.memory_report()
    result = image_result(args, spec, ds, defaults, trainer, hist, wall, comm, rep)
    if args.json:
        print(json.dumps(result))
    else:
        print_image_report(args, trainer, hist, result, rep)
    return 0


def _load_images(args: argparse.Namespace, defaults: D.TrainDefaults, loader: str):
    """The image dataset of ``--dataset`` (standardised where its defaults say so)."""
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
    return ds


def _image_trainer(args: argparse.Namespace, spec, ds, defaults: D.TrainDefaults,
                   comm) -> Trainer:
    """The image model, its optimizer and schedule, and their Trainer (resumed with
    ``--resume``)."""
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
    if device_memory == "auto":
        device_memory = spec.budget or _auto_memory(args, net, spec, ds.input_shape, link)
    try:
        trainer = Trainer(net, opt, memory=spec, device=args.device, device_memory=device_memory,
                          seed=args.seed, scheduler=scheduler, host_memory=args.host_memory,
                          loss=SoftmaxCrossEntropy(label_smoothing=args.label_smoothing),
                          clip_grad_norm=args.clip_grad_norm, precision=args.precision,
                          accumulate_grad_batches=args.accumulate_grad_batches,
                          emulate_link=link, comm=comm, sync_bn=args.sync_bn)
    except RuntimeError as e:  # the cuda device without a GPU
        raise RuntimeFailure(str(e)) from None
    except ValueError as e:  # ranks of an mpiexec job that disagree (model, spec, ...)
        raise UsageError(str(e)) from None
    trainer.announce_compilation = not args.quiet
    if args.resume:
        _resume(trainer, args.resume)
    return trainer


def _print_header(args: argparse.Namespace, spec, ds, trainer: Trainer,
                  defaults: D.TrainDefaults, augmented: bool, comm) -> None:
    """The line on stderr saying what is trained on what, how and where."""
    print(f"training {trainer.net.name} ({trainer.net.num_parameters():,} parameters) on "
          f"{ds.name}: {len(ds.x_train)} train / {len(ds.x_test)} test samples, input "
          f"{'x'.join(map(str, ds.input_shape))}"
          f"{f' ({ds.adaptation()})' if ds.adaptation() else ''}"
          f"{' (standardised with the train mean/std)' if ds.standardization else ''}"
          f"{f', {defaults.shift_probability:.0%} shifted by 1 px' if augmented else ''}"
          f"{f', label smoothing {args.label_smoothing:g}' if args.label_smoothing else ''}"
          f"{_gradient_note(args)}, "
          f"{_length(args, -(-len(ds.x_train) // args.batch_size))} of batch "
          f"{args.batch_size}, memory {spec.spec!r}, {trainer.device.name} device with "
          f"{format_bytes(trainer.device.capacity)}"
          + (f"; data-parallel over {comm.size} MPI ranks" if comm else ""),
          file=sys.stderr)


def _gradient_note(args: argparse.Namespace) -> str:
    """The header's words for --clip-grad-norm and --accumulate-grad-batches (when given)."""
    note = ""
    if args.clip_grad_norm is not None:
        note += f", gradients clipped to norm {args.clip_grad_norm:g}"
    if args.accumulate_grad_batches > 1:
        note += (f", gradients of {args.accumulate_grad_batches} batches per optimizer step "
                 f"(effective batch {args.accumulate_grad_batches * args.batch_size})")
    return note


def _length(args: argparse.Namespace, steps_per_epoch: int) -> str:
    """How long the run is: its epochs, or its steps when --max-steps ends it sooner."""
    epochs = f"{args.epochs} epoch{'s' if args.epochs != 1 else ''}"
    if args.max_steps is None or args.max_steps >= args.epochs * steps_per_epoch:
        return epochs
    return (f"{args.max_steps} step{'s' if args.max_steps != 1 else ''} (--max-steps; "
            f"{epochs} would be {args.epochs * steps_per_epoch})")


def _fit(args: argparse.Namespace, trainer: Trainer, ds, augment, comm, callbacks: list):
    """The epochs (recorded with --trace / --plot / --snapshot): the fit's history; a device
    out of memory carries the specs whose dry run fits it."""
    try:
        with ranks_stop_together(comm), _recorded(trainer, args):
            return trainer.fit(ds, epochs=args.epochs, batch_size=args.batch_size,
                               max_steps=args.max_steps, progress=not args.no_progress,
                               augment=augment, callbacks=callbacks,
                               val_every=0 if args.no_val else args.val_every,
                               progress_every=args.log_every)
    except ResumeMismatch as e:
        raise UsageError(f"--resume {args.resume}: {e}") from None
    except ImageReadError as e:  # (a streamed image, read when its batch came)
        raise RuntimeFailure(str(e)) from None
    except DeviceOutOfMemory as e:
        fits = suggest_specs(lambda: build_model(args.model, ds.input_shape, ds.num_classes,
                                            args.width), args.batch_size, ds.input_shape,
                             trainer.device.capacity, args.optimizer,
                             device_kind=trainer.device.kind, precision=args.precision)
        e.suggestions = fits
        raise
