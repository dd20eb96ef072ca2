"""A trainer's checkpoints: what :meth:`Trainer.save <minidl.train.trainer.Trainer.save>`
writes and :meth:`Trainer.load <minidl.train.trainer.Trainer.load>` restores (the file format
and its atomic writes: :mod:`minidl.interop.checkpoint`).

A checkpoint is an ``.npz`` of ``param/*`` (parameters and buffers), ``optim/*``, ``sched/*``,
``trainer/*`` (iteration, seed, where :meth:`fit` stands, the epoch's figures so far) and
``callback/<key>/<name>`` entries.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...compile.deferred import resolve_all
from ...interop.checkpoint import (
    DAMAGED,
    CheckpointError,
    damage,
    describe_file,
    describe_npz,
    resume_position,
    write_npz,
)
from ...net.graph import Network
from ..callbacks import callback_states

#: The prefix of fp16-mixed's loss-scaler entries (:mod:`~minidl.train.precision.loss_scaling`).
SCALER = "trainer/loss_scaler/"
#: What :meth:`Trainer.load` says a file should have been.
EXPECTED = "a minidl checkpoint (.npz written by Trainer.save or minidl train --save)"


def checkpoint_arrays(trainer: Any) -> dict[str, Any]:
    """The entries of ``trainer``'s checkpoint (a :class:`~minidl.train.trainer.Trainer`)."""
    arrays: dict[str, Any] = {f"param/{k}": v for k, v in trainer.net.state_dict().items()}
    for k, v in trainer.optimizer.state_dict().items():
        arrays[f"optim/{k}"] = np.asarray(v)
    if trainer.scheduler is not None:
        for k, v in trainer.scheduler.state_dict().items():
            arrays[f"sched/{k}"] = np.asarray(v)
    arrays["trainer/iteration"] = np.asarray(trainer.iteration)
    scaler = getattr(trainer, "loss_scaler", None)
    if scaler is not None:
        for k, v in scaler.state_dict().items():
            arrays[f"{SCALER}{k}"] = np.asarray(v)
    arrays["trainer/seed"] = np.asarray(trainer.seed)
    arrays["trainer/epoch"] = np.asarray(trainer.fit_state.epoch)
    arrays["trainer/epoch_step"] = np.asarray(trainer.fit_state.epoch_step)
    arrays["trainer/steps_per_epoch"] = np.asarray(trainer.fit_state.steps_per_epoch or 0)
    if trainer.fit_state.augment_rng is not None:
        arrays["trainer/augment_rng"] = np.asarray(
            json.dumps(trainer.fit_state.augment_rng.bit_generator.state))
    arrays["trainer/epoch_losses"] = np.asarray(resolve_all(trainer.fit_state.epoch_losses),
                                                dtype=np.float64)
    arrays["trainer/epoch_accuracy"] = np.asarray(resolve_all(trainer.fit_state.epoch_accuracy),
                                                  dtype=np.float64)
    for key, state in callback_states(trainer.fit_state.callbacks).items():
        for name, value in state.items():
            arrays[f"callback/{key}/{name}"] = np.asarray(value)
    return arrays


def save_checkpoint(trainer: Any, path: str | os.PathLike) -> None:
    """Write ``trainer``'s checkpoint to ``path`` atomically (data-parallel: rank 0 only)."""
    path = os.fspath(path)
    arrays = checkpoint_arrays(trainer)
    if trainer.parallel is None:
        write_npz(path, arrays)
    else:
        trainer.parallel.root_writes(lambda: write_npz(path, arrays))


@dataclass
class Checkpoint:
    """What a checkpoint file holds, read whole before anything is restored."""

    params: dict[str, np.ndarray]
    optim: dict[str, np.ndarray]
    sched: dict[str, Any]
    iteration: int
    #: (epoch, epoch step, steps per epoch, augmentation generator) when read for a resume.
    position: tuple[Any, ...] | None
    epoch_losses: list[float]
    epoch_accuracy: list[float]
    callbacks: dict[str, dict[str, float]]
    #: fp16-mixed's loss-scaler state (empty in the other precisions).
    scaler: dict[str, Any]


def open_checkpoint(path: str) -> np.lib.npyio.NpzFile:
    """The ``.npz`` at ``path``, or the error saying what the file is instead."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist" + (
            " (it is a folder)" if os.path.isdir(path) else ""))
    try:
        z = np.load(path, allow_pickle=False)
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path} is damaged ({damage(e)}): not loaded, nothing "
                              "changed") from None
    except (ValueError, OSError, EOFError):
        raise CheckpointError(f"{path} is {describe_file(path)}, not {EXPECTED}") from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise CheckpointError(f"{path} is a single NumPy array (.npy) of shape {z.shape}, "
                              f"not {EXPECTED}")
    return z


def read_checkpoint(path: str, net: Network, resume: bool) -> Checkpoint:
    """Everything the checkpoint at ``path`` holds (the fit position only for a ``resume``);
    :class:`CheckpointError` when it is not a minidl checkpoint (``net`` helps say what it is)
    or is damaged."""
    with open_checkpoint(path) as z:
        if "trainer/iteration" not in z.files:
            raise CheckpointError(f"{path} is {describe_npz(z.files, net)}, not {EXPECTED}")
        try:
            params = {k[6:]: z[k] for k in z.files if k.startswith("param/")}
            optim = {k[6:]: z[k] for k in z.files if k.startswith("optim/")}
            sched = {k[6:]: z[k].item() for k in z.files if k.startswith("sched/")}
            iteration = int(z["trainer/iteration"])
            position = resume_position(path, z) if resume else None
            losses, accuracy = ([float(v) for v in z[k]] if k in z.files else []
                                for k in ("trainer/epoch_losses", "trainer/epoch_accuracy"))
            scaler = {k[len(SCALER):]: z[k].item() for k in z.files if k.startswith(SCALER)}
            callbacks: dict[str, dict[str, float]] = {}
            for k in z.files:
                if k.startswith("callback/"):
                    key, name = k[9:].rsplit("/", 1)
                    callbacks.setdefault(key, {})[name] = z[k].item()
        except DAMAGED as e:
            raise CheckpointError(f"{path} is damaged ({damage(e)}): not loaded, "
                                  "nothing changed") from None
    return Checkpoint(params, optim, sched, iteration, position, losses, accuracy, callbacks,
                      scaler)


def load_checkpoint(trainer: Any, path: str | os.PathLike, resume: bool = False) -> None:
    """Restore ``trainer`` from the checkpoint at ``path``: see :meth:`Trainer.load
    <minidl.train.trainer.Trainer.load>`. A failed load changes nothing."""
    path = os.fspath(path)
    ckpt = read_checkpoint(path, trainer.net, resume)
    if resume and (trainer.scheduler is None) != (not ckpt.sched):
        has = "has" if ckpt.sched else "has no"
        raise CheckpointError(f"checkpoint {path} {has} learning-rate scheduler state but "
                              f"this trainer {'has no' if trainer.scheduler is None else 'has a'}"
                              " scheduler: resume with the schedule the run was started with")
    restore_weights(trainer, path, ckpt)
    if ckpt.position is not None:
        if trainer.scheduler is not None:
            trainer.scheduler.load_state_dict(ckpt.sched)
        fs = trainer.fit_state
        fs.epoch, fs.epoch_step, fs.steps_per_epoch, fs.augment_rng = ckpt.position
        fs.restored_callback_state = ckpt.callbacks
        fs.epoch_losses, fs.epoch_accuracy = ckpt.epoch_losses, ckpt.epoch_accuracy


def restore_weights(trainer: Any, path: str, ckpt: Checkpoint) -> None:
    """Parameters, buffers, optimizer state and the iteration counter from ``ckpt``; all of
    them as they were, and :class:`CheckpointError`, when they do not match."""
    before = (trainer.net.state_dict(), trainer.optimizer.state_dict(), trainer.iteration)
    try:
        trainer.net.load_state_dict(ckpt.params)
        trainer.optimizer.load_state_dict(
            {k: (v.item() if v.ndim == 0 else v) for k, v in ckpt.optim.items()})
        trainer.iteration = ckpt.iteration
        if ckpt.scaler and getattr(trainer, "loss_scaler", None) is not None:
            trainer.loss_scaler.load_state_dict(ckpt.scaler)
    except (KeyError, ValueError) as e:
        trainer.net.load_state_dict(before[0])
        trainer.optimizer.load_state_dict(before[1])
        trainer.iteration = before[2]
        reason = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise CheckpointError(f"checkpoint {path} does not match this network "
                              f"({trainer.net.name}) or optimizer "
                              f"({type(trainer.optimizer).__name__}): {reason}") from None
