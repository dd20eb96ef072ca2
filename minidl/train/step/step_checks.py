"""A training step's checks that the numbers stay finite: the loss, and the gradients' global
norm when clipping; on a GPU a step does not wait for the device, so both are checked when the
loss is read (:class:`~minidl.compile.deferred.Deferred`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...compile.compiled import Compiled
from ...compile.deferred import Deferred
from ...compile.executor import NonFiniteError
from ...memory.runtime.transfer import fetch_async
from ...net.optim import clip_grad_norm_


def check_accumulation(k: Any) -> int:
    """``accumulate_grad_batches``: a whole number >= 1 (``ValueError`` naming it otherwise)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"accumulate_grad_batches must be a whole number >= 1, got {k!r}")
    return int(k)


def check_clip_norm(value: Any) -> float | None:
    """``clip_grad_norm``: ``None`` (no clipping) or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not np.isfinite(value) or value <= 0:
        raise ValueError(f"clip_grad_norm must be a number > 0 (the gradients' largest global "
                         f"L2 norm), got {value!r}")
    return float(value)


def checked_loss(pending: Any, iteration: int) -> float:
    """A deferred loss's value, or NonFiniteError naming the iteration it came from."""
    value = float(pending.result()[()])
    if not np.isfinite(value):
        raise NonFiniteError(f"the loss is {value} at iteration {iteration} (read after "
                             "later steps were queued: on a GPU the loss is checked when "
                             "it is read)")
    return value


def clip_gradients(optimizer: Any, params: Any, max_norm: float, device: Any, loss: Any,
                   iteration: int) -> Any:
    """Clip the gradients' global norm to ``max_norm`` (``optimizer``'s shards under
    ``zero=2``, else ``params``' ``.grad``); a non-finite norm raises. Returns ``loss``, or
    when it is deferred, a deferred loss that checks the norm when read."""
    if getattr(optimizer, "shards_gradients", False):  # zero=2: over the ranks
        norm = optimizer.clip_grad_norm(max_norm)
    else:
        norm = clip_grad_norm_(params, max_norm)

    def checked_norm(value: float) -> None:
        if not np.isfinite(value):
            raise NonFiniteError(f"gradient norm is {value} at iteration {iteration}")

    if not isinstance(loss, Deferred):
        checked_norm(float(fetch_async(device, norm).result()[()]))
        return loss
    pending = fetch_async(device, norm)

    def read() -> float:
        checked_norm(float(pending.result()[()]))
        return loss.read()

    return Deferred(read, lambda: pending.ready() and loss.ready())


def raise_at_non_finite_layer(c: Compiled, x: np.ndarray, y: np.ndarray, seed: int,
                              iteration: int) -> None:
    """Re-run the forward pass of ``c`` checking each layer's output; raises naming the first
    layer whose output is not finite. Buffers (BN running stats) are left untouched."""
    c.executor.run([x, y], training=True, seed=seed, iteration=iteration,
                   check_finite=True, recomputing=True)
