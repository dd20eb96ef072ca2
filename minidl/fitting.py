"""The training loop of :meth:`Trainer.fit <minidl.trainer.Trainer.fit>`: epochs of batches,
a progress bar, per-step measurements in a :class:`History`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .data import batches
from .kernels.jit import CompileWatch
from .memory.units import format_size


@dataclass
class History:
    """What :meth:`Trainer.fit` measured."""

    losses: list[float] = field(default_factory=list)
    train_accuracy: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    test_loss: float | None = None
    test_accuracy: float | None = None
    wall_time_s: float = 0.0


def fit(
    trainer: Any,
    data: Any,
    epochs: int = 1,
    batch_size: int = 64,
    max_steps: int | None = None,
    progress: bool = True,
    evaluate: bool = True,
    shuffle: bool = True,
    augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None,
) -> History:
    """Train ``trainer`` (a :class:`~minidl.trainer.Trainer`) on ``data`` (a
    :class:`~minidl.data.Dataset` or ``(x, y)``) for ``epochs`` (or ``max_steps``), showing a
    progress bar; evaluates on the test split at the end.

    ``augment(x_batch, rng)`` returns the images a step trains on instead of ``x_batch``
    (for instance :func:`~minidl.data.random_shift`); ``rng`` is seeded by the trainer's seed
    and the epoch, so a run is reproducible.

    The first step compiles the Numba kernels it uses unless Numba's on-disk cache has them:
    the bar then says so and restarts its clock once they are compiled, so its rate and ETA
    are the training's."""
    from tqdm.auto import tqdm

    if isinstance(data, tuple):
        x_train, y_train = data
        x_test = y_test = None
    else:
        x_train, y_train, x_test, y_test = data.x_train, data.y_train, data.x_test, data.y_test
    hist = History()
    t_start = time.perf_counter()
    steps_per_epoch = -(-len(x_train) // batch_size)
    total = steps_per_epoch * epochs if max_steps is None else min(
        max_steps, steps_per_epoch * epochs)
    bar = tqdm(total=total, disable=not progress, unit="step", dynamic_ncols=True)

    def announce_compiling() -> None:
        if progress:
            bar.write("compiling kernels (first run only)...", file=sys.stderr)

    done = 0
    trainer.fetch_logits = True
    try:
        for epoch in range(epochs):
            augment_rng = np.random.default_rng([trainer.seed, epoch, 1])
            for xb, yb in batches(x_train, y_train, batch_size, shuffle=shuffle,
                                  seed=trainer.seed, epoch=epoch):
                if max_steps is not None and done >= max_steps:
                    break
                if augment is not None:
                    xb = augment(xb, augment_rng)
                t0 = time.perf_counter()
                if done == 0:
                    with CompileWatch(on_first_compile=announce_compiling) as watch:
                        loss = trainer.step(xb, yb)
                    if watch.compiled and progress:
                        bar.write(f"kernels compiled in {watch.seconds:.1f} s", file=sys.stderr)
                        bar.reset()
                else:
                    loss = trainer.step(xb, yb)
                dt = time.perf_counter() - t0
                hist.losses.append(loss)
                hist.step_times.append(dt)
                acc = float("nan")
                if trainer.last_logits is not None and len(trainer.last_logits) == len(yb):
                    acc = float((trainer.last_logits.argmax(axis=-1) == yb).mean())
                hist.train_accuracy.append(acc)
                done += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", acc=f"{acc:.3f}",
                                samples_s=f"{len(xb) / dt:,.0f}",
                                peak=format_size(trainer.peak.bytes if trainer.peak else 0),
                                refresh=False)
            if trainer.scheduler is not None:
                trainer.scheduler.step()
            if max_steps is not None and done >= max_steps:
                break
    finally:
        bar.close()
        trainer.fetch_logits = False
    if evaluate and x_test is not None and len(x_test):
        hist.test_loss, hist.test_accuracy = trainer.evaluate(x_test, y_test, batch_size)
    hist.wall_time_s = time.perf_counter() - t_start
    return hist
