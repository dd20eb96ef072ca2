"""Eval-mode passes of a :class:`~minidl.train.trainer.Trainer`: one batch's forward (in
halves when the device cannot hold it) and the mean loss and accuracy over a split."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...memory.runtime.pool import DeviceOutOfMemory
from ...net.labels import default_label_shape
from .inputs import check_inputs


def forward_eval(trainer: Any, xb: np.ndarray, yb: np.ndarray | None) -> tuple[Any, Any]:
    """Eval-mode forward of one batch: (mean loss, outputs). A batch that does not fit the
    device memory runs in halves (inference needs no batch statistics across them)."""
    if yb is None:  # placeholder class labels: (N,) or, for sequence models, (N, T)
        yb = np.zeros(default_label_shape(trainer.net, tuple(xb.shape)), dtype=np.int64)
    c = trainer._compiled(xb, yb, training=False)
    try:
        loss, outs = c.executor.run([xb, yb], training=False, seed=trainer.seed,
                                    iteration=trainer.iteration, fetch_outputs=True)
        trainer.observed.note_evaluation(c.executor.last_runtime.peak.bytes, len(xb))
        return loss, outs[0]
    except DeviceOutOfMemory:
        if len(xb) < 2:
            raise
    trainer.observed.eval_splits += 1  # (said in memory_report's notes)
    h = len(xb) // 2
    l1, o1 = forward_eval(trainer, xb[:h], yb[:h])
    l2, o2 = forward_eval(trainer, xb[h:], yb[h:])
    return (l1 * h + l2 * (len(xb) - h)) / len(xb), np.concatenate([o1, o2])


def evaluate(trainer: Any, x: Any, y: Any, batch_size: int = 256) -> tuple[float, float]:
    """Mean loss and accuracy (argmax over the last axis) in eval mode. ``x`` may be a
    streamed image array (:class:`~minidl.datasets.loaders.ImageArray`): read batch by batch."""
    streamed = not isinstance(x, np.ndarray) and hasattr(x, "take")
    if streamed:
        y = np.asarray(y)
        if len(y) != len(x):
            raise ValueError(f"{len(x)} inputs but {len(y)} labels")
    else:
        x, y = check_inputs(trainer.net, x, y)
    total_loss, correct, n, n_labels = 0.0, 0, 0, 0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i:i + batch_size], y[i:i + batch_size]
        if streamed:
            xb, yb = check_inputs(trainer.net, xb, yb)
        with trainer._compile_notice():
            loss, logits = trainer._forward_eval(xb, yb)
        total_loss += float(loss) * len(xb)
        if np.issubdtype(yb.dtype, np.integer):
            correct += int((logits.argmax(axis=-1) == yb).sum())
        n += len(xb)
        n_labels += yb.size
    return total_loss / max(n, 1), correct / max(n_labels, 1)
