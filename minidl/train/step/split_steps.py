"""A training batch the device cannot hold whole, run as micro-batches (``split=K``, or ``auto``
under a budget it meets only by splitting): the weight gradients accumulate in ``.grad``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...compile.executor import NonFiniteError
from ..precision.loss_scaling import current_scale


def split_gradients(trainer: Any, x: np.ndarray, y: np.ndarray, k: int) -> float:
    """The batch as ``k`` micro-batches; weight gradients accumulate in ``.grad``, each
    micro-batch's loss gradient scaled by its share of the batch (equal to the full batch's
    gradients up to float summation order). Returns the batch's mean loss."""
    if trainer.net.buffers():
        raise ValueError(
            "batch splitting with BatchNorm would normalise with micro-batch statistics, "
            "not the batch's: use a larger budget or device memory, or a smaller batch")
    for p in trainer.net.parameters():
        if p.grad is not None:
            p.grad.fill(0)
    n = len(x)
    micro = -(-n // k)
    total = 0.0
    for i in range(0, n, micro):
        xb, yb = x[i:i + micro], y[i:i + micro]
        c = trainer.engine.compiled([xb.shape], tuple(yb.shape), True, yb.dtype.name,
                                    accumulate=True)
        share = len(xb) / n
        loss, _ = c.executor.run([xb, yb], training=True, seed=trainer.seed,
                                 iteration=trainer.iteration,
                                 loss_scale=share * current_scale(trainer.loss_scaler),
                                 record=trainer.observed.recorder is not None)
        if trainer.engine.compute and (loss is None or not np.isfinite(loss)):
            raise NonFiniteError(f"the loss is {loss} at iteration {trainer.iteration}")
        total += (loss or 0.0) * share
        trainer._calibrate_link(c)
        trainer.observed.note_peak(c, trainer.iteration)
        trainer.last_compiled = c
    trainer.observed.last_split = k
    return total
