"""What ``minidl train`` reports when a run ends: the ``--json`` object of an image run, the
text report of image and text runs (steps, test or validation figures, the precision, the
emulated link, the memory report)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from ..datasets import data as D
from ..memory.ir.precision import Precision
from ..train.trainer import Trainer
from .common import print_memory_report

__all__ = ["image_result", "precision_entries", "print_image_report", "print_link",
           "print_precision", "print_text_report"]


def precision_entries(trainer: Trainer) -> dict[str, Any]:
    """The run's precision, and for fp16-mixed its loss scaler's final scale and the steps it
    skipped (inf / NaN gradients)."""
    out: dict[str, Any] = {"precision": trainer.precision.value}
    scaler = trainer.loss_scaler
    if scaler is not None:
        out.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
    return out


def print_precision(result: dict[str, Any]) -> None:
    """The report's precision line (from :func:`precision_entries`' entries of ``result``)."""
    half = Precision.of(result["precision"]).half_dtype
    line = f"precision: {result['precision']}"
    if half is not None:
        line += f" ({half} compute, float32 master weights)"
    if "loss_scale" in result:
        skipped = result["skipped_steps"]
        line += (f", final loss scale {result['loss_scale']:g}, {skipped} step"
                 f"{'' if skipped == 1 else 's'} skipped (inf/NaN gradients)")
    print(line)


def print_text_report(steps: int, res: dict[str, Any], result: dict[str, Any],
                      rep: dict[str, Any]) -> None:
    """A text model's run as text: its steps, validation, precision, link and memory."""
    print(f"steps: {steps}, final training loss {result['final_loss']:.4f}, median step "
          f"{1000 * result['step_time_median_s']:.1f} ms, wall time {res['wall_time_s']:.1f} s")
    print(f"validation loss {res['val_loss']:.4f} nats/char, perplexity "
          f"{res['val_perplexity']:.2f}")
    print_precision(result)
    print_link(rep)
    print_memory_report(rep, out=sys.stdout)  # the stream now (tests capture it)

def print_link(rep: dict) -> None:
    """The emulated link's line of the report (``--emulate-link``)."""
    link = rep.get("link_emulation")
    if link and link["slowdown"] is not None:
        stall = rep.get("swap", {}).get("stall_s")
        print(f"emulated {link['target']} link: this CPU computes {link['slowdown']:.0f}x "
              f"slower than a {link['target']}, so copies were throttled to "
              f"{link['link_bytes_per_s'] / 1e6:.1f} MB/s ({link['target']}: "
              f"{link['target_link_bytes_per_s'] / 1e9:.1f} GB/s)"
              + ("" if stall is None else f"; last step's stall {1000 * stall:.2f} ms"))


def image_result(args: argparse.Namespace, spec, ds, defaults: D.TrainDefaults,
                 trainer: Trainer, hist, wall: float, comm, rep: dict) -> dict:
    """The run's results (``--json``'s object)."""
    return {
        "model": args.model,
        "dataset": ds.name,
        "memory": spec.spec,
        "losses": hist.losses,
        "final_loss": last_epoch_loss(hist, trainer.iteration)[0],
        "final_loss_over": last_epoch_loss(hist, trainer.iteration)[1],
        "last_step_loss": hist.losses[-1] if hist.losses else None,
        "test_loss": hist.test.loss,
        "test_accuracy": hist.test.accuracy,
        "peak_allocated_bytes": rep["peak_allocated_bytes"],
        "peak_reserved_bytes": rep["peak_reserved_bytes"],
        "step_time_median_s": float(np.median(hist.step_times)) if hist.step_times else None,
        "wall_time_s": wall,
        "steps": len(hist.losses),
        "iteration": trainer.iteration,
        "epochs": args.epochs,
        "epoch_logs": hist.epochs,
        "stopped_early": hist.stopping.early,
        "weight_decay": args.weight_decay,
        "input_mean": None if ds.standardization is None else ds.standardization.mean,
        "input_std": None if ds.standardization is None else ds.standardization.std,
        "label_smoothing": args.label_smoothing,
        "clip_grad_norm": args.clip_grad_norm,
        "accumulate_grad_batches": args.accumulate_grad_batches,
        "batch_size": args.batch_size,
        "ranks": 1 if comm is None else comm.size,
        "shift_probability": defaults.shift_probability,
        "memory_report": rep,
        **precision_entries(trainer),
    }


def last_epoch_loss(hist, iteration: int) -> tuple[float | None, str]:
    """The mean training loss of the last epoch this fit ran, and the words saying what it
    is: a whole epoch's mean, or where the run stopped inside an epoch (``--max-steps``) the
    mean of its steps since the last whole one. ``iteration``: the trainer's at the end."""
    if not hist.losses:
        return None, ""
    if hist.epochs and hist.epochs[-1]["step"] == iteration:
        return float(hist.epochs[-1]["loss"]), f"epoch {hist.epochs[-1]['epoch'] + 1}'s mean"
    start = iteration - len(hist.losses)  # (a resumed run's first iteration)
    since = hist.epochs[-1]["step"] - start if hist.epochs else 0
    tail = [v for v in hist.losses[max(0, since):] if v == v]
    if not tail:
        return None, ""
    return float(np.mean(tail)), f"mean of the last {len(tail)} steps, inside an epoch"


def print_image_report(args: argparse.Namespace, trainer: Trainer, hist, result: dict,
                       rep: dict) -> None:
    """The run's results as text: the steps (or why none ran), the test figures, the
    precision, the emulated link and the memory report."""
    if hist.losses:
        final = result["final_loss"]
        print(f"steps: {len(hist.losses)}, training loss "
              f"{'nan' if final is None else f'{final:.4f}'} ({result['final_loss_over']}), "
              f"median step {1000 * (result['step_time_median_s'] or 0):.1f} ms, "
              f"wall time {result['wall_time_s']:.1f} s")
    elif hist.stopping.early:
        print(f"nothing to train: the run had stopped early at epoch {trainer.fit_state.epoch} of "
              f"{args.epochs} (step {trainer.iteration})")
    else:
        print(f"nothing to train: the run already stands at epoch {trainer.fit_state.epoch} of "
              f"{args.epochs} (step {trainer.iteration})")
    if hist.stopping.early and hist.losses and args.no_progress:
        print(hist.stopping.reason)  # (else the progress display said it)
    if hist.test.accuracy is not None:
        print(f"test loss {hist.test.loss:.4f}, test accuracy {100 * hist.test.accuracy:.2f}%")
    print_precision(result)
    print_link(rep)
    print_memory_report(rep, out=sys.stdout)  # the stream now (tests capture it)
