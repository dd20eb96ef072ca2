"""Callbacks of :meth:`Trainer.fit <minidl.train.trainer.Trainer.fit>`: hooks called as training
goes (``on_train_begin`` / ``on_train_end``, ``on_epoch_begin`` / ``on_epoch_end``,
``on_step_end``, ``on_evaluate``) and the built-ins: :class:`EarlyStopping`,
:class:`ModelCheckpoint`, :class:`MetricLogger` (CSV or JSON lines), :class:`TensorBoard`
and :class:`ProgressLogger` (the progress bar, or plain lines when not on a terminal).

Every hook receives the :class:`FitRun` (the trainer, the history, the run's length) and a
``logs`` dict: after a step ``epoch``, ``step`` (the trainer's iteration counter after the
step), ``loss``, ``accuracy``, ``lr``, ``step_time_s``, ``samples_per_s``, ``peak_bytes``;
after an epoch ``epoch``, ``step``, the epoch's mean ``loss`` and ``accuracy``, ``lr`` (the
rate the epoch trained with), ``time_s``, ``peak_bytes`` and, when it was validated,
``val_loss`` and ``val_accuracy``; under fp16-mixed ``skipped_steps`` (since the start, for
inf / NaN gradients) and ``loss_scale``. Epochs are counted from 0 in ``logs`` and from 1 in
printed lines. On a GPU a step's ``loss`` and ``accuracy`` are
:class:`~minidl.compile.deferred.Deferred` (the host does not wait for the device until a callback
reads them); epoch logs hold floats.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from ..compile.deferred import is_ready, resolve
from ..memory.ir.units import format_size


@dataclass
class FitRun:
    """One :func:`~minidl.train.loop.fitting.fit` call as callbacks see it. A callback ends
    training by setting ``trainer.stop_training = True`` (with ``stop_reason`` for the
    record)."""

    trainer: Any
    history: Any
    epochs: int
    total_steps: int
    steps_per_epoch: int
    batch_size: int
    callbacks: list[Callback] = field(default_factory=list)
    stop_reason: str = ""

    def message(self, text: str) -> None:
        """A one-off line for the user (to the progress display, or stderr)."""
        for cb in self.callbacks:
            if isinstance(cb, ProgressLogger):
                cb.write(text)
                return

    def dispatch(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)


class Callback:
    """Base class: override the hooks you need (each does nothing by default)."""

    def on_train_begin(self, run: FitRun) -> None:
        """Before the first step of this :meth:`fit` call."""

    def on_epoch_begin(self, run: FitRun, epoch: int) -> None:
        """Before the first step of an epoch (or of what is left of it after a resume)."""

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        """After each training step."""

    def on_evaluate(self, run: FitRun, logs: dict[str, Any]) -> None:
        """After each validation (``val_loss``, ``val_accuracy``, ``epoch``, ``step``)."""

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        """After an epoch (and its validation); the scheduler has already stepped."""

    def on_train_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        """After the last step (``steps``, ``stopped_early``, ``stop_reason``)."""

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs to continue as if never interrupted (numbers only; saved
        in checkpoints by :meth:`Trainer.save <minidl.train.trainer.Trainer.save>`)."""
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` returned (a resumed run, before its first step)."""


def _state_keys(callbacks: list[Any]) -> list[tuple[str, Callback]]:
    """Each stateful callback's key: its class name and its rank among those of its class."""
    seen: dict[str, int] = {}
    out = []
    for cb in callbacks:
        name = type(cb).__name__
        seen[name] = seen.get(name, -1) + 1
        out.append((f"{name}.{seen[name]}", cb))
    return out


def callback_states(callbacks: list[Any]) -> dict[str, dict[str, float]]:
    """The non-empty :meth:`Callback.state_dict` of each callback, by a key stable across runs
    with the same callbacks (``EarlyStopping.0``)."""
    return {key: state for key, cb in _state_keys(callbacks)
            if isinstance(cb, Callback) and (state := cb.state_dict())}


def restore_callback_states(callbacks: list[Any], states: dict[str, dict[str, float]]) -> None:
    """Give each callback the state :func:`callback_states` saved under its key."""
    for key, cb in _state_keys(callbacks):
        if key in states and isinstance(cb, Callback):
            cb.load_state_dict(states[key])


def _mode_for(monitor: str, mode: str) -> str:
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be auto, min or max, got {mode!r}")
    if mode != "auto":
        return mode
    return "max" if "acc" in monitor else "min"


def renamed(who: str, new: str, new_value: Any, old: str, old_value: Any) -> Any:
    """The value of an argument given under its Lightning name ``new`` or its earlier name
    ``old`` (still taken); both at once is a ``TypeError``."""
    if new_value is not None and old_value is not None:
        raise TypeError(f"{who}: {old}= is the earlier name of {new}=: give one of them")
    return new_value if new_value is not None else old_value


def _check_monitor(run: FitRun, monitor: str, who: str) -> None:
    if monitor.startswith("val_") and not run.history.validating:
        raise ValueError(f"{who} monitors {monitor!r} but this fit does not validate: pass "
                         "validation_data= or data with a test split (and no val_every=0), or "
                         "monitor 'loss' / 'accuracy'")


class EarlyStopping(Callback):
    """Stop when ``monitor`` (an epoch log: ``val_loss`` by default) has not improved by more
    than ``min_delta`` for ``patience`` epochs in a row."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0,
                 mode: str = "auto") -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.monitor, self.patience, self.min_delta = monitor, int(patience), float(min_delta)
        self.mode = _mode_for(monitor, mode)
        self.best: float | None = None
        self.wait = 0

    def on_train_begin(self, run: FitRun) -> None:
        _check_monitor(run, self.monitor, "EarlyStopping")
        if self.wait >= self.patience:  # (a resumed run that had stopped early)
            self._stop(run)

    def state_dict(self) -> dict[str, float]:
        return {"best": math.nan if self.best is None else self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, float]) -> None:
        best = float(state["best"])
        self.best = None if math.isnan(best) else best
        self.wait = int(state["wait"])

    def _stop(self, run: FitRun) -> None:
        run.trainer.stop_training = True
        run.stop_reason = (f"early stopping: {self.monitor} has not improved on "
                           f"{self.best:.4f} for {self.patience} epoch(s)")

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        value = logs.get(self.monitor)
        if value is None or not math.isfinite(value):
            return
        if self.improved(value):
            self.best, self.wait = float(value), 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            self._stop(run)


class ModelCheckpoint(Callback):
    """Save the trainer (:meth:`Trainer.save`, atomic) to ``path`` every
    ``every_n_train_steps`` steps, at the end of every ``every_n_epochs`` epochs, and/or
    (``save_best``) after each epoch whose ``monitor`` is the best so far (Lightning's names;
    ``every_steps`` is the earlier name of ``every_n_train_steps``). ``path`` may hold
    ``{epoch}`` and ``{step}`` fields (one file per checkpoint)."""

    def __init__(self, path: str | os.PathLike, every_n_train_steps: int | None = None,
                 save_best: bool = False, monitor: str = "val_loss", mode: str = "auto",
                 every_n_epochs: int | None = None, every_steps: int | None = None) -> None:
        every_steps = renamed("ModelCheckpoint", "every_n_train_steps", every_n_train_steps,
                              "every_steps", every_steps)
        if every_steps is None and every_n_epochs is None and not save_best:
            raise ValueError("ModelCheckpoint needs every_n_train_steps=N, every_n_epochs=N or "
                             "save_best=True")
        for name, value in (("every_n_train_steps", every_steps),
                            ("every_n_epochs", every_n_epochs)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.path = os.fspath(path)
        self.every_steps, self.save_best = every_steps, save_best
        self.every_n_epochs = every_n_epochs
        self.monitor, self.mode = monitor, _mode_for(monitor, mode)
        self.best: float | None = None
        self.saved: list[str] = []

    def on_train_begin(self, run: FitRun) -> None:
        if self.save_best:
            _check_monitor(run, self.monitor, "ModelCheckpoint(save_best=True)")

    def state_dict(self) -> dict[str, float]:
        return {"best": math.nan if self.best is None else self.best} if self.save_best else {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if "best" in state:
            best = float(state["best"])
            self.best = None if math.isnan(best) else best

    def _save(self, run: FitRun, epoch: int) -> None:
        path = self.path.format(epoch=epoch + 1, step=run.trainer.iteration)
        run.trainer.save(path)
        self.saved.append(path)

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self.every_steps and run.trainer.iteration % self.every_steps == 0:
            self._save(run, logs["epoch"])

    @property
    def every_n_train_steps(self) -> int | None:
        return self.every_steps

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self.every_n_epochs and (logs["epoch"] + 1) % self.every_n_epochs == 0:
            self._save(run, logs["epoch"])
        value = logs.get(self.monitor)
        if not self.save_best or value is None or not math.isfinite(value):
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best = float(value)
            self._save(run, logs["epoch"])


#: The columns of :class:`MetricLogger`'s CSV files.
CSV_COLUMNS = ("kind", "epoch", "step", "loss", "accuracy", "lr", "val_loss", "val_accuracy",
               "time_s", "peak_bytes")


class MetricLogger(Callback):
    """One row per epoch (and every ``every_steps`` steps, if given) to ``path``: CSV
    (columns :data:`CSV_COLUMNS`, ``kind`` is ``epoch`` or ``step``) or, for ``.jsonl`` /
    ``.json``, one JSON object per line. Each row is flushed as written, so the file is
    complete up to the last row if the run dies. ``append`` continues an existing file (a
    resumed run) instead of starting a new one."""

    def __init__(self, path: str | os.PathLike, log_every_n_steps: int | None = None,
                 append: bool = False, every_steps: int | None = None) -> None:
        every_steps = renamed("MetricLogger", "log_every_n_steps", log_every_n_steps,
                              "every_steps", every_steps)
        self.path = os.fspath(path)
        self.jsonl = self.path.lower().endswith((".jsonl", ".json", ".ndjson"))
        self.every_steps = every_steps
        self.append = append
        self._file: TextIO | None = None
        self._csv: Any = None

    def on_train_begin(self, run: FitRun) -> None:
        new = not (self.append and os.path.exists(self.path) and os.path.getsize(self.path))
        self._file = open(self.path, "w" if new else "a", newline="", encoding="utf-8")
        if not self.jsonl:
            self._csv = csv.DictWriter(self._file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            if new:
                self._csv.writeheader()

    def _write(self, kind: str, logs: dict[str, Any]) -> None:
        if self._file is None:
            return
        row = {"kind": kind, **{k: resolve(v) for k, v in logs.items()}}
        if self.jsonl:
            self._file.write(json.dumps(row) + "\n")
        else:
            self._csv.writerow({k: ("" if row.get(k) is None else row[k]) for k in CSV_COLUMNS})
        self._file.flush()

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self.every_steps and logs["step"] % self.every_steps == 0:
            self._write("step", logs)

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        self._write("epoch", logs)

    def on_train_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def tensorboard_writer(logdir: str) -> Any:
    """A ``SummaryWriter`` from ``tensorboardX``, else ``torch.utils.tensorboard``; raises
    ``ImportError`` naming both when neither is installed."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("TensorBoard logging needs tensorboardX (pip install tensorboardX) "
                              "or torch with tensorboard (pip install torch tensorboard)") from None
    return SummaryWriter(logdir)


class TensorBoard(Callback):
    """Scalars for TensorBoard in ``logdir``: the step loss and learning rate every
    ``every_steps`` steps, the epoch metrics and validations. Needs ``tensorboardX`` or
    ``torch.utils.tensorboard`` (checked when constructed)."""

    def __init__(self, logdir: str | os.PathLike, log_every_n_steps: int | None = None,
                 every_steps: int | None = None) -> None:
        every_steps = renamed("TensorBoard", "log_every_n_steps", log_every_n_steps,
                              "every_steps", every_steps)
        self.writer = tensorboard_writer(os.fspath(logdir))
        self.every_steps = max(1, int(10 if every_steps is None else every_steps))

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if logs["step"] % self.every_steps == 0:
            self.writer.add_scalar("train/loss", resolve(logs["loss"]), logs["step"])
            self.writer.add_scalar("train/lr", logs["lr"], logs["step"])

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            value = logs.get(key)
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(f"epoch/{key}", value, logs["epoch"] + 1)

    def on_train_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        self.writer.close()


#: Runs expected to take longer than this (seconds) say so once their first steps are timed.
LONG_RUN_S = 120.0
#: Steps timed for the estimate (after the fit's first, which may compile kernels).
ESTIMATE_STEPS = 5


def format_duration(seconds: float) -> str:
    """``seconds`` as a person says it: 45 s, 3.2 min, 12.9 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class RunEstimate:
    """The run's expected time from its first timed steps (the fit's first step, which may
    compile kernels, left out): one line when the steps left would take over
    :data:`LONG_RUN_S`, else nothing."""

    def __init__(self, steps: int = ESTIMATE_STEPS, long_s: float = LONG_RUN_S) -> None:
        self.steps, self.long_s = steps, long_s
        self.times: list[float] = []
        self.done = False

    def observe(self, run: FitRun, logs: dict[str, Any]) -> str | None:
        if self.done:
            return None
        done = run.history.start_step + len(run.history.losses)
        if len(run.history.losses) > 1:  # (not the fit's first step)
            self.times.append(float(logs["step_time_s"]))
        left = run.total_steps - done
        if len(self.times) < self.steps or left <= 0:
            if left <= 0:
                self.done = True
            return None
        self.done = True
        per_step = float(np.median(self.times))
        expected = per_step * left
        if expected <= self.long_s:
            return None
        return (f"expected time: about {format_duration(expected)} for the {left:,} steps left "
                f"({1000 * per_step:,.0f} ms a step over steps {done - len(self.times) + 1}-"
                f"{done}; evaluations not counted); --max-steps N shortens the run")


def _fmt(value: Any, spec: str) -> str:
    value = resolve(value)
    return "nan" if value is None or not math.isfinite(value) else format(value, spec)


class ProgressLogger(Callback):
    """The progress display: a tqdm bar when ``stream`` (default stderr) is a terminal;
    otherwise no carriage returns, one line per epoch and one every ``every_steps`` steps (if
    given), fit for log files. ``interactive`` overrides the terminal check."""

    def __init__(self, stream: TextIO | None = None, log_every_n_steps: int | None = None,
                 interactive: bool | None = None, every_steps: int | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = interactive if interactive is not None else bool(isatty and isatty())
        self.every_steps = renamed("ProgressLogger", "log_every_n_steps", log_every_n_steps,
                                   "every_steps", every_steps)
        self.bar: Any = None
        self.estimate = RunEstimate()

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def say_expected_time(self, run: FitRun, logs: dict[str, Any]) -> None:
        """Once the first steps are timed: a line with the run's expected time, when long."""
        line = self.estimate.observe(run, logs)
        if line:
            self.write(line)

    def restart_clock(self) -> None:
        """Forget the time spent so far (kernel compilation) in the bar's rate and ETA."""
        if self.bar is not None:
            n = self.bar.n
            self.bar.reset()
            self.bar.update(n)

    def on_train_begin(self, run: FitRun) -> None:
        if self.interactive:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=run.total_steps, initial=run.history.start_step, unit="step",
                            dynamic_ncols=True, file=self.stream)

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        self.say_expected_time(run, logs)
        peak = format_size(logs["peak_bytes"])
        if self.bar is not None:
            self.bar.update(1)
            # (on a GPU the step's loss may still be on its way: the bar shows the figures once
            # they are there instead of making the host wait for them)
            if is_ready(logs["loss"]) and is_ready(logs["accuracy"]):
                self.bar.set_postfix(loss=f"{logs['loss']:.4f}", acc=f"{logs['accuracy']:.3f}",
                                     samples_s=f"{logs['samples_per_s']:,.0f}", peak=peak,
                                     refresh=False)
        elif self.every_steps and logs["step"] % self.every_steps == 0:
            self.write(f"step {logs['step']}/{run.total_steps} (epoch {logs['epoch'] + 1}): "
                       f"loss {_fmt(logs['loss'], '.4f')}, accuracy "
                       f"{_fmt(logs['accuracy'], '.3f')}, lr {logs['lr']:.4g}, "
                       f"{logs['samples_per_s']:,.0f} samples/s, peak {peak}")

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self.bar is not None and "val_loss" not in logs and "skipped_steps" not in logs:
            return
        line = (f"epoch {logs['epoch'] + 1}/{run.epochs}: loss {_fmt(logs['loss'], '.4f')}, "
                f"accuracy {_fmt(logs['accuracy'], '.3f')}")
        if "val_loss" in logs:
            line += (f", val_loss {_fmt(logs['val_loss'], '.4f')}, val_accuracy "
                     f"{_fmt(logs['val_accuracy'], '.3f')}")
        line += f", lr {logs['lr']:.4g}, {logs['time_s']:.1f} s (step {logs['step']})"
        if "skipped_steps" in logs:
            line += (f", {logs['skipped_steps']} steps skipped (inf/NaN gradients), loss scale "
                     f"{logs['loss_scale']:g}")
        self.write(line)

    def on_train_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if logs.get("stop_reason"):
            self.write(logs["stop_reason"])
