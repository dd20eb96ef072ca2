"""One training batch in this process, and the optimizer's update after it: the Trainer's
hot path (:class:`~minidl.train.trainer.Trainer` keeps the state; these functions run it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...compile.compiled import Compiled
from ...compile.deferred import Deferred
from ...compile.executor import NonFiniteError
from ...memory.runtime.cache import without_cache
from ...memory.runtime.pool import DeviceOutOfMemory
from ..precision.loss_scaling import current_scale
from .split_steps import split_gradients
from .step_checks import checked_loss, clip_gradients, raise_at_non_finite_layer

__all__ = ["calibrate_link", "local_gradients", "optimizer_step"]


def local_gradients(trainer: Any, x: np.ndarray, y: np.ndarray, wait: bool = True) -> Any:
    """This process's forward and backward on a batch (``k`` micro-batches where the engine
    splits it, :func:`~.split_steps.split_gradients`): the loss (deferred on a GPU when not
    ``wait``), ``.grad`` written (or added into, inside an accumulation window)."""
    k = trainer.engine.split_for([x.shape], tuple(y.shape), y.dtype.name)
    accumulating = trainer.accumulate_grad_batches > 1
    if k > 1:
        if accumulating:
            raise ValueError(f"accumulate_grad_batches={trainer.accumulate_grad_batches} "
                             f"with a batch the device runs in {k} parts: give a budget "
                             "or device memory that holds the whole batch")
        return split_gradients(trainer, x, y, k)
    # (accumulating: the window's first batch writes .grad, the others add into it)
    c = trainer._compiled(x, y, training=True,
                          accumulate=accumulating and trainer.accumulated > 0)
    record = trainer.observed.recorder is not None
    run = dict(training=True, seed=trainer.seed, iteration=trainer.iteration,
               fetch_outputs=trainer.fetch_logits, record=record, hooks=trainer.parallel,
               wait=False)
    if accumulating or trainer.loss_scaler is not None:
        run["loss_scale"] = current_scale(trainer.loss_scaler) / trainer.accumulate_grad_batches
    try:
        loss, outs = c.executor.run([x, y], **run)
    except DeviceOutOfMemory:
        if not c.plan.swapping.cache:
            raise
        # the tensor cache kept swapped tensors resident until even evicting all of them
        # left memory too fragmented: from now on release them at once (plain swapping)
        c = trainer.engine.replace_plan(c, without_cache(c.plan))
        trainer.observed.cache_fallbacks += 1
        loss, outs = c.executor.run([x, y], **run)
    trainer.last_compiled = c
    calibrate_link(trainer, c)
    iteration = trainer.iteration
    deferred = not wait and trainer.asynchronous
    if trainer.engine.compute:
        if loss is None:
            raise NonFiniteError(f"the program computed no loss at iteration {iteration}")
        if deferred:
            pending = loss
            loss = Deferred(lambda: checked_loss(pending, iteration), pending.ready)
        else:  # (the loss first: it comes after the outputs, one wait covers both)
            loss = float(loss.result()[()])
            if not np.isfinite(loss):
                raise_at_non_finite_layer(c, x, y, trainer.seed, iteration)
                raise NonFiniteError(
                    f"the loss is {loss} at iteration {iteration} although every layer's "
                    "output is finite")
    if outs:
        trainer.last_logits = outs[0] if deferred else outs[0].result()
    trainer.observed.after_iteration(c, trainer.iteration)
    trainer._to_refine = c
    return loss if loss is not None else float("nan")


def calibrate_link(trainer: Any, c: Compiled) -> None:
    """With link emulation: the CPU's slowdown from this iteration's measured step times,
    and the copy engine's throttle from it."""
    emu = trainer.link_emulation
    if emu is not None and trainer.engine.compute:
        emu.observe(c.plan.program, c.executor.step_times)
        trainer.device.link_bytes_per_s = emu.bytes_per_s


def optimizer_step(trainer: Any, loss: Any = None) -> Any:
    """Clip (``clip_grad_norm``) and update from the gradients in ``.grad``; the loss,
    deferred with the norm's check when clipping a deferred one. Under fp16-mixed the
    gradients are unscaled first, and a step with inf / NaN gradients is skipped (the
    scaler backs off)."""
    if trainer.loss_scaler is not None:
        finite = _unscale(trainer)
        trainer.loss_scaler.update(finite)
        if not finite:
            trainer.accumulated = 0
            return loss
    if trainer.clip_grad_norm is not None:
        # a non-finite norm raises (on a GPU when the loss is read: the norm comes with it)
        loss = clip_gradients(trainer.optimizer, trainer.net.parameters(),
                              trainer.clip_grad_norm, trainer.device, loss, trainer.iteration)
    trainer.optimizer.step()
    trainer.accumulated = 0
    return loss


def _unscale(trainer: Any) -> bool:
    """fp16-mixed: divide the gradients by the loss scale; whether they are finite on every
    rank (under ``zero=2`` / ``3`` each rank holds only its shards, so the ranks agree on the
    skip over the communicator; else every rank holds the same all-reduced gradients)."""
    if getattr(trainer.optimizer, "shards_gradients", False):
        return trainer.optimizer.unscale_shards(trainer.loss_scaler)
    return trainer.loss_scaler.unscale(trainer.net.parameters())
