"""Where :meth:`Trainer.fit <minidl.train.trainer.Trainer.fit>` stands and what its callbacks
keep: the state the fit loop owns and checkpoints save (``trainer.fit_state``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class FitState:
    """Epochs completed (``epoch``), batches done in the current one (``epoch_step``) of a run
    of ``steps_per_epoch``, the generator of the current epoch's augmentation, the epoch's step
    losses and training accuracies (its log's means), the callbacks of the latest fit (their
    state goes into checkpoints) and the state a resumed checkpoint holds for the next fit's
    callbacks."""

    epoch: int = 0
    epoch_step: int = 0
    steps_per_epoch: int | None = None
    augment_rng: np.random.Generator | None = None
    epoch_losses: list[Any] = field(default_factory=list)
    epoch_accuracy: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)
    restored_callback_state: dict[str, dict[str, float]] = field(default_factory=dict)
