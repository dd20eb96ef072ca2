"""The training loop: :meth:`Trainer.fit <minidl.train.trainer.Trainer.fit>` and the text models'
:func:`~minidl.zoo.rnn.train_language_model` both run :func:`fit` — epochs of batches from a
:class:`~minidl.train.loop.batch_sources.BatchSource` (image epochs, text windows), from where the
trainer stands (a resumed run continues mid-epoch), per-epoch validation, callbacks
(:mod:`minidl.train.callbacks`), per-step measurements in a :class:`History`."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...compile.deferred import Deferred, resolve_all
from ...kernels.jit import CompileWatch
from ..callbacks import Callback, FitRun, ProgressLogger, restore_callback_states
from ..step.step_checks import check_accumulation, check_clip_norm
from .batch_sources import BatchSource, ImageEpochs


@dataclass
class TestScores:
    """The final evaluation on the test split (``None`` when there was none)."""

    loss: float | None = None
    accuracy: float | None = None


@dataclass
class Stopping:
    """Whether a fit stopped before its last step (``trainer.stop_training``), and why."""

    early: bool = False
    reason: str = ""


@dataclass
class History:
    """What :meth:`Trainer.fit` measured in this call: per step (``losses``,
    ``train_accuracy``, ``step_times``, ``lrs``), per epoch (``epochs``: the epoch logs, with
    the validation when there was one), the final test evaluation (``test``) and how the run
    ended (``stopping``)."""

    losses: list[float] = field(default_factory=list)
    train_accuracy: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    test: TestScores = field(default_factory=TestScores)
    wall_time_s: float = 0.0
    #: The fit position (epoch * steps per epoch + batch) this call started from.
    start_step: int = 0
    validating: bool = False
    stopping: Stopping = field(default_factory=Stopping)


class ResumeMismatch(ValueError):
    """A resumed run continued with other data or another batch size (raised before any
    step)."""


def _split(data: Any) -> tuple[Any, Any, Any, Any]:
    if isinstance(data, tuple):
        return data[0], data[1], None, None
    return data.x_train, data.y_train, data.x_test, data.y_test


def _source_and_test(data: Any, batch_size: int, shuffle: bool, augment: Any
                     ) -> tuple[BatchSource, Any, Any]:
    """What fit iterates (``data`` itself when it is a batch source) and the test split."""
    if hasattr(data, "batches") and hasattr(data, "steps_per_epoch"):
        return data, None, None
    x_train, y_train, x_test, y_test = _split(data)
    return ImageEpochs(x_train, y_train, batch_size, shuffle, augment), x_test, y_test


def _validation(validation_data: Any, val_every: int | None, x_test: Any, y_test: Any
                ) -> tuple[Any, int]:
    """The data validated on (or None) and every how many epochs: by default every epoch, on
    ``validation_data`` or else the dataset's held-out (test) split when it has one;
    ``val_every=0`` never."""
    if val_every is not None and (isinstance(val_every, bool) or val_every < 0):
        raise ValueError(f"val_every must be >= 1 (or 0: no validation), got {val_every}")
    if val_every == 0:
        return None, 1
    held_out = x_test is not None and len(x_test) > 0
    if validation_data is None and val_every is not None and not held_out:
        raise ValueError("val_every needs validation_data=(x, y) or a dataset with a test "
                         "split")
    if validation_data is None and held_out:
        validation_data = (x_test, y_test)
    return validation_data, val_every or 1


#: The batch size of ``fit``, ``minidl train`` and ``minidl plan`` when none is given (one
#: figure, so that a plan describes the run it plans).
DEFAULT_BATCH_SIZE = 32

#: Lightning's names for fit's arguments (also taken).
LIGHTNING_NAMES = {"max_epochs": "epochs", "check_val_every_n_epoch": "val_every"}


def _lightning_names(given: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """``own`` (fit's arguments) with the values given under Lightning's names; a name fit
    does not know, or both names of one argument, is a ``TypeError``."""
    for name, value in given.items():
        if name not in LIGHTNING_NAMES:
            raise TypeError(f"fit() got an unexpected keyword argument {name!r}")
        ours = LIGHTNING_NAMES[name]
        if own[ours] is not None and own[ours] != FIT_DEFAULTS.get(ours):
            raise TypeError(f"fit() got both {ours}= and {name}= (the same argument)")
        own[ours] = value
    return own


FIT_DEFAULTS = {"epochs": 1, "val_every": None}


def _place(trainer: Any, source: BatchSource) -> None:
    """Put the trainer at the run's position in ``source``: a text source's is the trainer's
    iteration; an epoch source's is the trainer's epoch and batch, which must belong to a run
    with as many batches per epoch."""
    steps_per_epoch = source.steps_per_epoch
    fs = trainer.fit_state
    if source.position_is_iteration:
        fs.epoch, fs.epoch_step = 0, min(trainer.iteration, steps_per_epoch)
    elif fs.steps_per_epoch not in (None, steps_per_epoch) and (fs.epoch or fs.epoch_step):
        raise ResumeMismatch(f"the trainer stands at epoch {fs.epoch + 1}, batch "
                             f"{fs.epoch_step} of a run with {fs.steps_per_epoch} "
                             f"batches per epoch, but this data and batch size give "
                             f"{steps_per_epoch}: resume with the same data and batch size")
    trainer.fit_state.steps_per_epoch = steps_per_epoch


def fit(
    trainer: Any,
    data: Any,
    epochs: int = 1,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_steps: int | None = None,
    progress: bool = True,
    evaluate: bool = True,
    shuffle: bool = True,
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None,
    callbacks: Sequence[Callback] = (),
    validation_data: tuple[Any, Any] | None = None,
    val_every: int | None = None,
    progress_every: int | None = None,
    accumulate_grad_batches: int | None = None,
    clip_grad_norm: float | None = None,
    **lightning_names: Any,
) -> History:
    """Train ``trainer`` (a :class:`~minidl.train.trainer.Trainer`) on ``data`` (a
    :class:`~minidl.datasets.data.Dataset`, ``(x, y)``, or a
    :class:`~minidl.train.loop.batch_sources.BatchSource` such as text windows) until ``epochs``
    epochs (or ``max_steps``
    batches) have been trained, counted from the start of the run: a trainer that already
    trained, or was restored with ``load(path, resume=True)``, continues where it stood (mid
    epoch too: same batch order, augmentation and dropout masks as an uninterrupted run).
    Evaluates on the test split at the end (``evaluate``).

    ``validation_data`` (``(x, y)``, else the dataset's test split when it has one) is
    evaluated every ``val_every`` epochs (default 1; 0: never). ``accumulate_grad_batches=K``
    sums the gradients of K batches (each loss scaled by 1/K) per optimizer step, the last
    window of an epoch (or of the fit) stepping with what it has; ``clip_grad_norm`` clips
    their global L2 norm before each step (both default to the trainer's). ``max_epochs`` and
    ``check_val_every_n_epoch`` (Lightning's names) are taken too. ``callbacks`` get the hooks of
    :class:`~minidl.train.callbacks.Callback`. ``progress`` shows a bar on a terminal, otherwise one
    line per epoch (and every ``progress_every`` steps).

    ``augment(x_batch, rng)`` returns the images a step trains on instead of ``x_batch``
    (for instance :func:`~minidl.datasets.data.random_shift`); ``rng`` is seeded by the trainer's
    seed
    and the epoch, and saved in checkpoints, so a run is reproducible and resumable.

    The first step compiles the Numba kernels it uses unless Numba's on-disk cache has them:
    the display then says so and restarts its clock once they are compiled."""
    named = _lightning_names(lightning_names, {"epochs": epochs, "val_every": val_every})
    epochs, val_every = named["epochs"], named["val_every"]
    _check_counts(epochs=epochs, batch_size=batch_size, max_steps=max_steps)
    with _trainer_settings(trainer, accumulate_grad_batches, clip_grad_norm):
        return _fit(trainer, data, epochs, batch_size, max_steps, progress, evaluate, shuffle,
                    augment, callbacks, validation_data, val_every, progress_every)


@contextlib.contextmanager
def _trainer_settings(trainer: Any, accumulate_grad_batches: int | None,
                      clip_grad_norm: float | None):
    """The trainer's accumulation and clipping set for one fit (checked), then restored."""
    saved = (trainer.accumulate_grad_batches, trainer.clip_grad_norm)
    if accumulate_grad_batches is not None:
        trainer.accumulate_grad_batches = check_accumulation(accumulate_grad_batches)
        if accumulate_grad_batches > 1 and trainer.parallel is not None:
            raise ValueError("accumulate_grad_batches > 1 is for one process without zero=2 "
                             "(data-parallel ranks all-reduce each batch's gradients)")
    if clip_grad_norm is not None:
        trainer.clip_grad_norm = check_clip_norm(clip_grad_norm)
    try:
        yield
    finally:
        trainer.accumulate_grad_batches, trainer.clip_grad_norm = saved


def _fit(trainer: Any, data: Any, epochs: int, batch_size: int, max_steps: int | None,
         progress: bool, evaluate: bool, shuffle: bool, augment: Any,
         callbacks: Sequence[Callback], validation_data: Any, val_every: int | None,
         progress_every: int | None) -> History:
    source, x_test, y_test = _source_and_test(data, batch_size, shuffle, augment)
    validation_data, val_every = _validation(validation_data, val_every, x_test, y_test)
    _place(trainer, source)
    steps_per_epoch = source.steps_per_epoch
    total = steps_per_epoch * epochs if max_steps is None else min(
        max_steps, steps_per_epoch * epochs)
    fs = trainer.fit_state
    hist = History(start_step=fs.epoch * steps_per_epoch + fs.epoch_step,
                   validating=validation_data is not None)
    shown = [ProgressLogger(log_every_n_steps=progress_every)] if progress else []
    run = FitRun(trainer, hist, epochs, total, steps_per_epoch, batch_size,
                 [*callbacks, *shown])
    t_start = time.perf_counter()
    trainer.stop_training = False
    trainer.fetch_logits = source.accuracy
    fs.callbacks = list(callbacks)
    if fs.restored_callback_state:  # (a resumed run: the callbacks as they were)
        restore_callback_states(fs.callbacks, fs.restored_callback_state)
        fs.restored_callback_state = {}
    end_logs: dict[str, Any] = {}
    announce = trainer.announce_compilation
    # the progress display says when kernels compile; without progress, fit stays silent
    trainer.announce_compilation = False
    try:
        run.dispatch("on_train_begin")
        _train(run, source, validation_data, val_every)
        trainer.finish_accumulation()  # (a fit ending mid-window: no gradients lost)
        hist.stopping = Stopping(trainer.stop_training, run.stop_reason)
        end_logs = {"steps": len(hist.losses), "stopped_early": hist.stopping.early,
                    "stop_reason": hist.stopping.reason}
    finally:
        trainer.fetch_logits = False
        trainer.announce_compilation = announce
        run.dispatch("on_train_end", end_logs)
    # (a GPU's deferred figures, read once: the device has long finished most of them)
    hist.losses[:] = resolve_all(hist.losses)
    hist.train_accuracy[:] = resolve_all(hist.train_accuracy)
    if evaluate and x_test is not None and len(x_test):
        hist.test = TestScores(*trainer.evaluate(x_test, y_test, batch_size))
    hist.wall_time_s = time.perf_counter() - t_start
    return hist


def _check_counts(**counts: Any) -> None:
    """``fit``'s counts each a whole number >= 1 (``max_steps`` also None): a ``ValueError``
    naming the argument and its value, rather than a fit that trains nothing."""
    for name, value in counts.items():
        if value is None and name == "max_steps":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"fit: {name} must be a whole number >= 1, got {value!r}")


def _position(trainer: Any) -> int:
    fs = trainer.fit_state
    return fs.epoch * fs.steps_per_epoch + fs.epoch_step


def _train(run: FitRun, source: BatchSource, validation_data: tuple[Any, Any] | None,
           val_every: int) -> None:
    """The epochs and batches of one :func:`fit` call, from the trainer's position."""
    trainer, hist = run.trainer, run.history
    first = True
    while trainer.fit_state.epoch < run.epochs and _position(trainer) < run.total_steps \
            and not trainer.stop_training:
        epoch = trainer.fit_state.epoch
        if trainer.fit_state.epoch_step == 0 or trainer.fit_state.augment_rng is None:
            trainer.fit_state.augment_rng = np.random.default_rng([trainer.seed, epoch, 1])
        run.dispatch("on_epoch_begin", epoch)
        t_epoch = time.perf_counter()
        lr = trainer.optimizer.lr
        if trainer.fit_state.epoch_step == 0:
            trainer.fit_state.epoch_losses, trainer.fit_state.epoch_accuracy = [], []
        # (streamed images, minidl.datasets.loaders.ImageArray: the next batch read on a thread)
        todo = source.batches(trainer, epoch, trainer.fit_state.epoch_step)
        with contextlib.closing(todo):
            for xb, yb in todo:
                if _position(trainer) >= run.total_steps or trainer.stop_training:
                    break
                _step(run, source.prepare(xb, trainer), yb, epoch, first)
                first = False
        if trainer.fit_state.epoch_step < run.steps_per_epoch:
            break  # stopped mid-epoch: the position stays there
        trainer.finish_accumulation()  # (the epoch's last, partial window)
        logs = {"epoch": epoch, "step": trainer.iteration,
                "loss": _mean(trainer.fit_state.epoch_losses),
                "accuracy": _mean(trainer.fit_state.epoch_accuracy),
                "lr": lr, "time_s": time.perf_counter() - t_epoch,
                "peak_bytes": trainer.observed.peak.bytes if trainer.observed.peak else 0}
        scaler = getattr(trainer, "loss_scaler", None)
        if scaler is not None:  # fp16-mixed: steps skipped for inf / NaN gradients so far
            logs.update(skipped_steps=scaler.skipped, loss_scale=scaler.scale)
        if validation_data is not None and (epoch + 1) % val_every == 0:
            val_loss, val_acc = trainer.evaluate(*validation_data, batch_size=max(
                run.batch_size, 256))
            val = {"epoch": epoch, "step": trainer.iteration, "val_loss": val_loss,
                   "val_accuracy": val_acc}
            logs.update(val)
            run.dispatch("on_evaluate", val)
        if trainer.scheduler is not None and source.steps_scheduler:
            trainer.scheduler.step()
        trainer.fit_state.epoch, trainer.fit_state.epoch_step = epoch + 1, 0
        trainer.fit_state.augment_rng = None
        hist.epochs.append(logs)
        run.dispatch("on_epoch_end", logs)


def _mean(values: list[Any]) -> float:
    finite = [v for v in resolve_all(values) if v == v]
    return float(np.mean(finite)) if finite else float("nan")


def _accuracy(logits: Any, labels: np.ndarray) -> Any:
    """Training accuracy of one step's output: a float, or on a GPU (the logits still on their
    way to the host) a :class:`~minidl.compile.deferred.Deferred` computed when read."""
    if logits is None:
        return float("nan")
    if isinstance(logits, np.ndarray):
        return _accuracy_of(logits, labels)
    return Deferred(lambda: _accuracy_of(logits.result(), labels), logits.ready)


def _accuracy_of(logits: np.ndarray, labels: np.ndarray) -> float:
    if len(logits) != len(labels):
        return float("nan")
    return float((logits.argmax(axis=-1) == labels).mean())


def _step(run: FitRun, xb: np.ndarray, yb: np.ndarray, epoch: int, first: bool) -> None:
    """One training step, its measurements and the ``on_step_end`` hooks."""
    trainer, hist = run.trainer, run.history
    lr = trainer.optimizer.lr
    # a GPU: the host does not wait for the step (its figures are read when shown or logged)
    step = functools.partial(trainer.step, wait=False) \
        if getattr(trainer, "asynchronous", False) else trainer.step
    t0 = time.perf_counter()
    if first:
        with CompileWatch(on_first_compile=lambda: run.message(
                "compiling kernels (first run only)...")) as watch:
            loss = step(xb, yb)
        if watch.compiled:
            run.message(f"kernels compiled in {watch.seconds:.1f} s")
            for cb in run.callbacks:
                if isinstance(cb, ProgressLogger):
                    cb.restart_clock()
    else:
        loss = step(xb, yb)
    dt = time.perf_counter() - t0
    trainer.fit_state.epoch_step += 1
    acc = _accuracy(trainer.last_logits, yb) if trainer.fetch_logits else float("nan")
    hist.losses.append(loss)
    hist.step_times.append(dt)
    hist.train_accuracy.append(acc)
    # (the epoch's figures so far: in checkpoints, so that an epoch a resume cuts logs all of it)
    trainer.fit_state.epoch_losses.append(loss)
    trainer.fit_state.epoch_accuracy.append(acc)
    hist.lrs.append(lr)
    run.dispatch("on_step_end", {
        "epoch": epoch, "step": trainer.iteration, "loss": loss, "accuracy": acc, "lr": lr,
        "step_time_s": dt, "samples_per_s": len(xb) / dt if dt > 0 else float("inf"),
        "peak_bytes": trainer.observed.peak.bytes if trainer.observed.peak else 0})
