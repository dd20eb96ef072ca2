"""Training a text model: :func:`train_language_model` runs the one training loop
(:func:`~minidl.train.loop.fitting.fit`) over a token stream's random windows
(:class:`~minidl.train.loop.batch_sources.TextWindows`), with the text models' progress lines,
validation every N steps on fixed windows, and the validation loss and perplexity at the end."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from ...compile.deferred import resolve, resolve_all
from ...datasets.text import sequence_batches
from ..callbacks import Callback, FitRun, ProgressLogger
from .batch_sources import TextWindows
from .fitting import fit

#: Steps between two progress lines of :func:`train_language_model` off a terminal (the text
#: models' "epoch": ``minidl train`` runs 100 steps per ``--epochs``).
LOG_EVERY_STEPS = 100
#: Seconds between two progress lines while validating.
VALIDATION_LINE_S = 5.0


def train_language_model(trainer: Any, data: Any, batch_size: int, seq_len: int,
                         steps: int, eval_batches: int = 20, progress: bool = True,
                         seed: int = 0, progress_every: int | None = None,
                         stream: TextIO | None = None, interactive: bool | None = None,
                         on_step: Callable[[int], None] | None = None,
                         val_every: int | None = None) -> dict[str, Any]:
    """Train on random windows of ``data.train`` until the trainer has run ``steps`` steps,
    then report validation loss (nats per character) and perplexity on ``eval_batches`` fixed
    windows of ``data.val``.

    The run starts at ``trainer.iteration``: after ``Trainer.load(path, resume=True)`` it
    continues with the windows the interrupted run had not reached (the window sequence is
    fixed by ``seed``), so 10 steps + save + resume + 10 equal 20 steps bit for bit.
    ``on_step(k)`` is called after step ``k`` (counted from the run's start; checkpoints).
    With ``val_every`` the validation loss is also measured after every ``val_every``-th step
    (the same windows; one progress line each, and ``(step, loss)`` pairs in ``val_history``).

    Progress goes to ``stream`` (default stderr) as :func:`~minidl.train.loop.fitting.fit` shows
    it: a bar on a terminal; otherwise (a log file, a pipe) no carriage returns, one line every
    ``progress_every`` steps (default :data:`LOG_EVERY_STEPS`) and one after the last step.
    ``interactive`` overrides the terminal check."""
    t0 = time.perf_counter()
    display = TextProgress(steps, batch_size * seq_len, progress_every or LOG_EVERY_STEPS, t0,
                           stream, interactive) if progress else None

    def validate() -> float:
        return validation_loss(trainer, data.val, batch_size, seq_len, eval_batches, seed,
                               None if display is None else display.write)

    checks = WindowValidation(val_every, steps, validate, display, t0)
    hooks: list[Callback] = [*([display] if display is not None else []), checks]
    if on_step is not None:
        hooks.append(AfterStep(on_step))
    hist = fit(trainer, TextWindows(data.train, batch_size, seq_len, steps, seed), epochs=1,
               batch_size=batch_size, progress=False, evaluate=False, callbacks=hooks)
    val_loss = validate()
    checks.history.append((steps, val_loss))
    scaler = getattr(trainer, "loss_scaler", None)  # fp16-mixed: its skips and scale
    return {"losses": list(hist.losses), "step_times": list(hist.step_times),
            "val_loss": val_loss, "val_perplexity": math.exp(val_loss),
            "val_history": checks.history, "wall_time_s": time.perf_counter() - t0,
            "scaler": {} if scaler is None else {"skipped_steps": scaler.skipped,
                                                 "loss_scale": scaler.scale}}


class TextProgress(ProgressLogger):
    """The text models' display: the bar (loss, characters per second) on a terminal, else a
    line every ``every`` steps and after the last (the mean loss and the rate since the last
    line)."""

    def __init__(self, steps: int, chars_per_step: int, every: int, t0: float,
                 stream: TextIO | None = None, interactive: bool | None = None) -> None:
        super().__init__(stream, interactive=interactive)
        self.steps, self.chars, self.every, self.t0 = steps, chars_per_step, every, t0

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=self.stream, flush=True)

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        self.say_expected_time(run, logs)
        k, times = run.trainer.fit_state.epoch_step, run.history.step_times
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{resolve(logs['loss']):.3f}",
                                 chars_s=f"{self.chars / times[-1]:,.0f}", refresh=False)
        elif k % self.every == 0 or k == self.steps:
            print(step_line(k, self.steps, self.every, resolve_all(run.history.losses), times,
                            self.chars, self.t0), file=self.stream, flush=True)

    def on_epoch_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        """(No epoch line: the text models' run is one stream of windows.)"""


class WindowValidation(Callback):
    """The validation loss after every ``every``-th step but the last (``history``: the
    ``(step, loss)`` pairs), said on ``display``."""

    def __init__(self, every: int | None, steps: int, validate: Callable[[], float],
                 display: TextProgress | None, t0: float) -> None:
        self.every, self.steps, self.validate = every, steps, validate
        self.display, self.t0 = display, t0
        self.history: list[tuple[int, float]] = []

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        k = run.trainer.fit_state.epoch_step
        if not self.every or k % self.every or k == self.steps:
            return
        self.history.append((k, self.validate()))
        if self.display is not None:
            self.display.write(f"step {k}/{self.steps}: validation loss "
                               f"{self.history[-1][1]:.4f} nats/char, "
                               f"{time.perf_counter() - self.t0:.1f} s")


class AfterStep(Callback):
    """``hook(k)`` after step ``k`` of the run (checkpoints of the text models)."""

    def __init__(self, hook: Callable[[int], None]) -> None:
        self.hook = hook

    def on_step_end(self, run: FitRun, logs: dict[str, Any]) -> None:
        self.hook(run.trainer.fit_state.epoch_step)


def step_line(k: int, steps: int, every: int, losses: list[float], times: list[float],
              chars: int, t0: float) -> str:
    """The progress line after step ``k`` off a terminal: the mean loss and the rate of the
    steps since the last line (``chars`` characters a step)."""
    since = min(k - (k - 1) // every * every, len(losses))  # since the last line
    return (f"step {k}/{steps}: loss {np.mean(losses[-since:]):.4f} (mean of the "
            f"last {since}), {chars * since / sum(times[-since:]):,.0f} chars/s, "
            f"{time.perf_counter() - t0:.1f} s")


def validation_loss(trainer: Any, text: Any, batch_size: int, seq_len: int,
                    eval_batches: int, seed: int, say: Callable[[str], None] | None) -> float:
    """Mean loss over ``eval_batches`` fixed windows of ``text`` (nats per char); with ``say``,
    a line when it starts and one every :data:`VALIDATION_LINE_S` seconds."""
    if say is not None:
        say(f"validating on {eval_batches} batches of {batch_size} x {seq_len} characters...")
    t_val = last = time.perf_counter()
    val = []
    for i, (xb, yb) in enumerate(sequence_batches(
            text, batch_size, seq_len, seed=seed + 1, num_batches=eval_batches), 1):
        val.append(trainer.evaluate(xb, yb, batch_size)[0])
        now = time.perf_counter()
        if say is not None and now - last >= VALIDATION_LINE_S and i < eval_batches:
            say(f"  validation batch {i}/{eval_batches}, {now - t_val:.1f} s")
            last = now
    return float(np.mean(val))
