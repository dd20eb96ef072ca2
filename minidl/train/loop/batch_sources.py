"""What :func:`~minidl.train.loop.fitting.fit` iterates: epochs of batches from a source.

- :class:`ImageEpochs`: shuffled batches of ``(x, y)`` arrays, an epoch a pass over them
  (optionally augmented); a run's position is the trainer's epoch and batch.
- :class:`TextWindows`: a language model's random windows of a token stream, one "epoch" of
  ``steps`` windows fixed by a seed; a run's position is the trainer's iteration, so a resumed
  run may go on with more steps than the one it resumes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from ...datasets.loaders import epoch_batches
from ...datasets.text import sequence_batches

Batches = Iterator[tuple[np.ndarray, np.ndarray]]


class BatchSource(Protocol):
    """A source of training batches for :func:`~minidl.train.loop.fitting.fit`."""

    #: Batches in one epoch.
    steps_per_epoch: int
    #: Whether fit measures a training accuracy (it fetches each step's outputs to do so).
    accuracy: bool
    #: Whether an epoch's end steps the trainer's learning-rate scheduler.
    steps_scheduler: bool
    #: Whether a run's position is the trainer's iteration (else its epoch and batch).
    position_is_iteration: bool

    def batches(self, trainer: Any, epoch: int, start: int) -> Batches:
        """Epoch ``epoch``'s batches from batch ``start`` on (closable)."""

    def prepare(self, x: np.ndarray, trainer: Any) -> np.ndarray:
        """The inputs a step trains on instead of ``x`` (augmented, or ``x`` itself)."""


class ImageEpochs:
    """Epochs of batches of ``(x, y)``, shuffled with the trainer's seed per epoch (streamed
    images read ahead on a thread), each batch optionally ``augment``-ed with the trainer's
    augmentation generator."""

    accuracy = True
    steps_scheduler = True
    position_is_iteration = False

    def __init__(self, x: Any, y: Any, batch_size: int, shuffle: bool = True,
                 augment: Callable[[np.ndarray, np.random.Generator], np.ndarray] | None = None
                 ) -> None:
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.augment = shuffle, augment
        self.steps_per_epoch = -(-len(x) // batch_size)

    def batches(self, trainer: Any, epoch: int, start: int) -> Batches:
        return epoch_batches(self.x, self.y, self.batch_size, shuffle=self.shuffle,
                             seed=trainer.seed, epoch=epoch, start=start)

    def prepare(self, x: np.ndarray, trainer: Any) -> np.ndarray:
        return x if self.augment is None else self.augment(x, trainer.fit_state.augment_rng)


class TextWindows:
    """``steps`` random windows of ``tokens`` (``batch_size`` x ``seq_len`` inputs, the next
    tokens as labels), the sequence fixed by ``seed`` whatever ``steps`` is."""

    accuracy = False
    steps_scheduler = False
    position_is_iteration = True

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, steps: int,
                 seed: int = 0) -> None:
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        self.steps_per_epoch = steps

    def batches(self, trainer: Any, epoch: int, start: int) -> Batches:
        windows = sequence_batches(self.tokens, self.batch_size, self.seq_len, seed=self.seed,
                                   num_batches=self.steps_per_epoch)
        yield from itertools.islice(windows, start, None)  # (a generator: closable)

    def prepare(self, x: np.ndarray, trainer: Any) -> np.ndarray:
        return x
