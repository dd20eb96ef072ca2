"""Ctrl-C during ``minidl train``: the run stops at the end of the step in progress, where the
trainer's state is whole, saves its ``--save`` checkpoint and says in one line where it stopped
and how to resume it (exit code 130). A second Ctrl-C stops at once (inside a step: nothing is
saved, the state may be half updated)."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
from typing import Any

from ..train.callbacks import Callback, ModelCheckpoint
from .common import EXIT_INTERRUPTED


class StepBoundaryInterrupt(KeyboardInterrupt):
    """Ctrl-C taken at the end of a step (the trainer's state whole: it can be saved)."""


class StopOnCtrlC(Callback):
    """A callback and a context: inside the ``with``, the first SIGINT only asks the run to
    stop; the next ``on_step_end`` (or :meth:`check`) raises :class:`StepBoundaryInterrupt`.
    The handler after it is Python's own (a second Ctrl-C raises at once). Without effect
    outside the main thread, or with ``enabled=False`` (the ranks of an mpiexec job, which
    must stop at the same step)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> StopOnCtrlC:
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second one: at once

    def check(self, *_: Any) -> None:
        if self.requested:
            raise StepBoundaryInterrupt

    def on_step_end(self, run: Any, logs: dict[str, Any]) -> None:
        self.check()


def resume_command(args: argparse.Namespace, path: str) -> str:
    """The command line that continues this run from checkpoint ``path``: the run's own
    (``args.argv``), less its ``--resume`` / ``--init-from``, with ``--resume path``."""
    argv = list(getattr(args, "argv", None) or ["train", args.model])
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--resume", "--init-from"):
            skip = True
            continue
        if a.startswith(("--resume=", "--init-from=")):
            continue
        out.append(a)
    return shlex.join(["minidl", *out, "--resume", path])


def report_interrupt(args: argparse.Namespace, trainer: Any, whole: bool, callbacks: list,
                     save: Any, steps: int | None = None) -> int:
    """After Ctrl-C: save the checkpoint when the state is ``whole`` and ``--save`` names one
    (``save(trainer, path)``), and print the one line (rank 0). Returns exit code 130."""
    step = trainer.iteration
    epoch = "" if steps is not None else f" (epoch {trainer.fit_state.epoch + 1} of {args.epochs})"
    of = "" if steps is None else f" of {steps}"  # (the text models: steps, no epochs)
    where = f"at step {step}{of}{epoch}" if whole else f"inside step {step + 1}{of}{epoch}"
    kept = [p for cb in callbacks if isinstance(cb, ModelCheckpoint) for p in cb.saved]
    if whole and args.save:
        save(trainer, args.save)
        path = os.path.abspath(args.save)
        if args.save.lower().endswith(".safetensors"):
            said = (f"weights saved to {path} (not resumable: start a new run from them with "
                    f"--init-from {args.save})")
        else:
            said = f"checkpoint saved to {path}; resume with: {resume_command(args, args.save)}"
    elif kept:
        said = (f"the step was cut short: the checkpoint of --save-every, {kept[-1]}, is the "
                f"last saved; resume with: {resume_command(args, kept[-1])}")
    else:
        said = "nothing saved" + ("" if args.save else " (--save FILE keeps a run to resume)")
    comm = getattr(getattr(trainer, "parallel", None), "comm", None)
    if comm is None or comm.rank == 0:
        print(f"minidl: interrupted {where}; {said}", file=sys.stderr)
    return EXIT_INTERRUPTED
