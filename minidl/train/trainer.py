"""The Trainer: one network, optimizer, loss and memory spec on one device; it steps,
evaluates and fits. Its parts live in the sub-packages beside it:
:mod:`~minidl.train.setup.device_setup`, :mod:`~minidl.train.state.checkpointing`,
:mod:`~minidl.train.observation.memory_report`, :mod:`~minidl.train.step.inputs`,
:mod:`~minidl.train.step.step_checks`, :mod:`~minidl.train.loop.fitting`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Unpack

import numpy as np

from ..analysis.memory_record import MemoryRecorder
from ..compile.compiled import Compiled
from ..interop.checkpoint import CheckpointError
from ..layers import SoftmaxCrossEntropy
from ..memory.ir.config import MemoryConfig
from ..memory.ir.precision import Precision
from ..net.graph import Network
from .loop.fitting import DEFAULT_BATCH_SIZE, History, fit
from .observation.compile_notice import compile_notice
from .observation.memory_report import memory_report
from .observation.run_observation import RunObservation
from .precision.precision_checks import check_precision, loss_scaler_for
from .setup.assembly import assemble
from .setup.trainer_options import TrainerKeywords, TrainerOptions
from .state.checkpointing import load_checkpoint, save_checkpoint
from .state.fit_state import FitState
from .step.evaluation import evaluate, forward_eval
from .step.inputs import check_inputs
from .step.local_step import calibrate_link, local_gradients, optimizer_step
from .step.step_checks import (
    check_accumulation,
    check_clip_norm,
)

#: ``CheckpointError`` has always been importable from here.
__all__ = ["CheckpointError", "Trainer"]


class Trainer:
    """Train ``net`` with ``optimizer`` under the memory spec ``memory`` on ``device``.

    ``device`` is ``"cpu"`` (default; its arena holds ``device_memory`` bytes), ``"cuda"``,
    ``"meta"`` (dry run, no compute) or a device object. ``device_memory="auto"`` (default):
    what the machine has (cpu: 3/4 of the host memory available; cuda: the GPU's free memory
    less what its libraries need; :func:`~minidl.memory.device_factory.make_device`).
    ``minidl train`` instead sizes it for the batch from dry runs
    (:func:`~minidl.analysis.dryrun.auto_device_memory`); pass that figure to get the same device.
    ``loss`` defaults to softmax cross-entropy over integer labels. ``debug=True`` fills freed
    blocks with NaN (default: ``MINIDL_DEBUG_POOL``, see :mod:`minidl.settings`). ``threads``
    sets the CPU kernels' thread count, process-wide (default: ``MINIDL_NUM_THREADS`` as
    applied at import, else Numba's count). ``alignment`` is the pool's allocation unit (plans
    are made for it).
    ``emulate_link`` (a target name such as ``"v100"`` or a profile; cpu device only) plans
    with that GPU's cost model and throttles the copy engine so that copy time / compute time
    is the GPU's (see :mod:`minidl.memory.cost.link_emulation`; ``link_emulation`` holds the
    measured slowdown and the rate). ``comm`` (a :class:`~minidl.distributed.comm.Communicator`
    of more than one rank) trains data-parallel (:mod:`minidl.distributed.data_parallel`;
    gradients all-reduced in buckets of ``bucket_bytes``; ``sync_bn``: BatchNorm with the global
    batch's statistics): each step's batch is the global batch, this rank trains on its shard,
    and only rank 0 writes checkpoints. ``zero=K`` in the spec shards the training state over
    the ranks (:mod:`minidl.distributed.zero`; from ``zero=2`` the gradients go through the
    buckets even on one rank, and ``.grad`` of the parameters stays ``None``: the optimizer's
    shards hold them). The device, its pool and the link emulation are made by
    :func:`~minidl.train.setup.device_setup.set_up_device`.

    The keywords above are the fields of ``options``
    (:class:`~minidl.train.setup.trainer_options.TrainerOptions`: device, step and data-parallel
    groups); a keyword given beside ``options`` overrides its field. The parts are assembled
    by :func:`~minidl.train.setup.assembly.assemble`; what the runs showed is in ``observed``
    (:class:`~minidl.train.observation.run_observation.RunObservation`: ``peak``,
    ``step_times``, ...), where :meth:`fit` stands in ``fit_state``
    (:class:`~minidl.train.state.fit_state.FitState`).
    """

    def __init__(self, net: Network, optimizer: Any = None, memory: str | MemoryConfig = "none",
                 options: TrainerOptions | None = None,
                 **keywords: Unpack[TrainerKeywords]) -> None:
        self.net = net
        self.config = MemoryConfig.parse(memory)
        options = (options or TrainerOptions()).with_keywords(dict(keywords))
        step = options.step
        #: What the steps compute in (:mod:`~minidl.memory.ir.precision`)
        self.precision = Precision.of(step.precision)
        self.loss_layer = step.loss if step.loss is not None else SoftmaxCrossEntropy()
        parts = assemble(net, optimizer, self.config, self.loss_layer, options)
        self.device, self.pool, self.engine = parts.device, parts.pool, parts.engine
        check_precision(self.precision, net, parts.traits.kind)
        #: fp16-mixed's dynamic loss scaler (:mod:`.loss_scaling`), else ``None``.
        self.loss_scaler = loss_scaler_for(self.precision)
        #: The device's traits, read once (:func:`~minidl.memory.devices.traits.device_traits`).
        self.device_traits = parts.traits
        #: The emulated host link (``emulate_link``), or ``None``.
        self.link_emulation = parts.link_emulation
        self.optimizer, self.parallel = parts.optimizer, parts.parallel
        #: True when the device runs behind the host (a GPU): steps can return before it has
        #: finished (``step(..., wait=False)``).
        self.asynchronous = self.device_traits.asynchronous and self.engine.compute
        self.scheduler = step.scheduler
        #: The gradients' largest global L2 norm (``torch.nn.utils.clip_grad_norm_``), or None.
        self.clip_grad_norm = check_clip_norm(step.clip_grad_norm)
        #: Gradients summed over this many batches (each batch's loss gradient scaled by
        #: 1/K) before one optimizer step, as Lightning's ``accumulate_grad_batches``.
        self.accumulate_grad_batches = check_accumulation(step.accumulate_grad_batches)
        #: Batches whose gradients ``.grad`` holds since the last optimizer step.
        self.accumulated = 0
        self.seed = int(step.seed)
        self.iteration = 0
        #: Peaks, step times, swapping and recording of the runs (:mod:`.run_observation`).
        self.observed = RunObservation(self.engine)
        #: Where :meth:`fit` stands and what its callbacks keep (:mod:`.fit_state`).
        self.fit_state = FitState()
        #: Set by a callback (e.g. :class:`~minidl.train.callbacks.EarlyStopping`) to end
        #: :meth:`fit`.
        self.stop_training = False
        #: With ``fetch_logits``, each training step keeps a copy of the network output in
        #: ``last_logits`` (for the training accuracy ``fit`` shows).
        self.fetch_logits = False
        self.last_logits: np.ndarray | None = None
        self.last_compiled: Any = None
        #: Say on stderr when the first steps compile Numba kernels (minutes of silence on a
        #: new machine otherwise); ``fit`` with progress says it its own way.
        self.announce_compilation = True
        self._kernels_ready = False
        self._to_refine: Compiled | None = None
        if self.accumulate_grad_batches > 1 and self.parallel is not None:
            raise ValueError("accumulate_grad_batches > 1 is for one process without zero=2 "
                             "(data-parallel ranks all-reduce each batch's gradients)")

    # ------------------------------------------------------------------ compiled steps
    def _compiled(self, x: np.ndarray, y: np.ndarray | None, training: bool,
                  accumulate: bool = False) -> Compiled:
        return self.engine.compiled([x.shape], None if y is None else tuple(y.shape), training,
                                    label_dtype="int64" if y is None else y.dtype.name,
                                    accumulate=accumulate)

    # ------------------------------------------------------------------ training
    def compute_gradients(self, x: Any, y: Any) -> float:
        """Forward and backward on a batch without updating: returns the loss, and every
        parameter's ``.grad`` holds its gradient. The iteration counter does not advance.
        Data-parallel: the global batch's loss and mean gradient, this rank ran its shard."""
        loss = self._gradients(x, y, wait=True)
        if self.loss_scaler is not None:  # (.grad as unscaled as in the other precisions)
            self.loss_scaler.unscale(self.net.parameters())
        self._refine()
        return loss

    def _gradients(self, x: Any, y: Any, wait: bool) -> Any:
        x, y = check_inputs(self.net, x, y)
        if self.parallel is None:
            return self._local_gradients(x, y, wait)
        loss = self.parallel.compute_gradients(self._local_gradients, x, y)
        if self.fetch_logits:
            self.last_logits = self.parallel.gather_rows(self.last_logits)
        return loss

    def _local_gradients(self, x: np.ndarray, y: np.ndarray, wait: bool = True) -> Any:
        """This process's forward and backward on a batch (:func:`.local_step.local_gradients`)."""
        return local_gradients(self, x, y, wait)

    def _refine(self) -> None:
        """After the step's work (the update's temporaries included): re-plan what depends on
        the measurements of the iteration (:meth:`Engine.refine
        <minidl.compile.engine.Engine.refine>`)."""
        c, self._to_refine = self._to_refine, None
        if c is not None:
            self.engine.refine(c)

    @property
    def swap_stats(self) -> dict[str, Any]:
        """What swapping did in the last iteration that swapped (bytes each way, the stall
        compute waited for copies, the tensor cache's hits; reading it on a GPU waits for that
        iteration's events); with ``offload=optimizer`` the gradients' bytes to the host, the
        parameters' bytes back and the host update's and copy back's seconds of the last
        step; empty when nothing was swapped or offloaded."""
        return self.observed.swap_stats(self.optimizer)

    def _calibrate_link(self, c: Compiled) -> None:
        """With link emulation: the copy engine's throttle from this iteration's step times
        (:func:`.local_step.calibrate_link`)."""
        calibrate_link(self, c)

    def step(self, x: Any, y: Any, wait: bool = True) -> Any:
        """One training step on a batch; returns the loss. Afterwards every parameter's
        ``.grad`` holds its gradient and the optimizer has updated ``.data``.

        ``wait=False`` on a GPU: the host does not wait for the device at all (no host
        synchronisation in the step): the loss comes back as a
        :class:`~minidl.compile.deferred.Deferred`, read (and checked for NaN / inf, with the
        gradient
        norm when clipping) when it is used. Elsewhere the loss is a float either way."""
        t0 = time.perf_counter()
        with self._compile_notice():
            loss = self._gradients(x, y, wait=wait or not self.asynchronous)
        c = self.last_compiled
        scope = c.executor.device_scope() if c is not None and self.engine.compute else \
            contextlib.nullcontext()
        self.accumulated += 1
        if self.accumulated >= self.accumulate_grad_batches:
            with scope:  # (the device current, CuPy's temporaries in the arena)
                loss = self._optimizer_step(loss)
        self._refine()
        self.observed.step_times.append(time.perf_counter() - t0)
        self.iteration += 1
        return loss

    def _optimizer_step(self, loss: Any = None) -> Any:
        """Unscale, clip and update from ``.grad`` (:func:`.local_step.optimizer_step`)."""
        return optimizer_step(self, loss)

    def finish_accumulation(self) -> bool:
        """The optimizer step of a partial accumulation window (an epoch's last batches, or a
        fit ending mid-window), so no batch's gradients are lost; whether it stepped."""
        if not self.accumulated:
            return False
        c = self.last_compiled
        scope = c.executor.device_scope() if c is not None and self.engine.compute else \
            contextlib.nullcontext()
        with scope:
            self._optimizer_step()
        return True

    @contextmanager
    def _compile_notice(self) -> Iterator[None]:
        """Say on stderr when Numba compiles this machine's kernels inside the block (the
        first run on a machine: tens of seconds), and how long it took; silent once a step
        compiled nothing, or with ``announce_compilation`` off (``fit`` shows its own)."""
        if not self.announce_compilation or self._kernels_ready:
            yield
            return

        with compile_notice() as watch:
            yield
        if not watch.compiled:
            self._kernels_ready = True

    def predict(self, x: Any, batch_size: int = 256) -> np.ndarray:
        """Network outputs (eval mode) for ``x``, in batches."""
        outs = []
        x, _ = check_inputs(self.net, x, None)
        for i in range(0, len(x), batch_size):
            xb = x[i:i + batch_size]
            outs.append(self._forward_eval(xb, None)[1])
        return np.concatenate(outs)

    def _forward_eval(self, xb: np.ndarray, yb: np.ndarray | None):
        """Eval-mode forward of one batch: (mean loss, outputs); see
        :func:`~minidl.train.step.evaluation.forward_eval`."""
        return forward_eval(self, xb, yb)

    def evaluate(self, x: Any, y: Any, batch_size: int = 256) -> tuple[float, float]:
        """Mean loss and accuracy (argmax over the last axis) in eval mode. ``x`` may be a
        streamed image array (:class:`~minidl.datasets.loaders.ImageArray`): read batch by batch."""
        return evaluate(self, x, y, batch_size)

    def fit(
        self,
        data: Any,
        epochs: int = 1,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_steps: int | None = None,
        progress: bool = True,
        evaluate: bool = True,
        shuffle: bool = True,
        augment: Any = None,
        callbacks: Any = (),
        validation_data: tuple[Any, Any] | None = None,
        val_every: int | None = None,
        progress_every: int | None = None,
        accumulate_grad_batches: int | None = None,
        clip_grad_norm: float | None = None,
        **lightning_names: Any,
    ) -> History:
        """Train on ``data`` (a :class:`~minidl.datasets.data.Dataset` or ``(x, y)``) until
        ``epochs`` epochs (or ``max_steps`` batches) counted from the start of the run have
        been trained (a resumed trainer continues); validates every ``val_every`` epochs on
        ``validation_data`` (or the test split), calls ``callbacks``
        (:mod:`minidl.train.callbacks`), evaluates on the test split at the end; see
        :func:`minidl.train.loop.fitting.fit`. ``accumulate_grad_batches`` and ``clip_grad_norm``
        set the trainer's for this call; Lightning's names ``max_epochs`` and
        ``check_val_every_n_epoch`` are taken for ``epochs`` and ``val_every``."""
        return fit(self, data, epochs=epochs, batch_size=batch_size, max_steps=max_steps,
                   progress=progress, evaluate=evaluate, shuffle=shuffle, augment=augment,
                   callbacks=callbacks, validation_data=validation_data, val_every=val_every,
                   progress_every=progress_every, accumulate_grad_batches=accumulate_grad_batches,
                   clip_grad_norm=clip_grad_norm, **lightning_names)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | os.PathLike) -> None:
        """Parameters, buffers, optimizer and scheduler state, the iteration counter and where
        :meth:`fit` stands (epoch, batch, augmentation generator) to ``.npz``, written
        atomically (a temporary file renamed into place): everything
        ``load(path, resume=True)`` needs to continue bit for bit."""
        save_checkpoint(self, path)

    def load(self, path: str | os.PathLike, resume: bool = False) -> None:
        """Restore what :meth:`save` wrote (names and shapes must match this network).

        Always: parameters, buffers, optimizer state and the iteration counter. With
        ``resume=True`` also the scheduler, the epoch and batch :meth:`fit` stood at and the
        augmentation generator, so that the next :meth:`fit` call continues the run exactly
        (same batches, masks and updates as without the interruption).

        Raises :class:`CheckpointError` saying what the file is when it is not a minidl
        checkpoint of this network (a plain ``np.savez``, a PyTorch file, text...) and
        ``FileNotFoundError`` when it does not exist; a failed load changes nothing.
        """
        load_checkpoint(self, path, resume)

    # ------------------------------------------------------------------ reports
    @contextmanager
    def record_memory(self) -> Iterator[MemoryRecorder]:
        """Record the memory of every training iteration run inside the ``with`` block
        (:meth:`step` or :meth:`fit`): each block event (alloc, free, prefetch, release) and
        plan action (offload, await, ...) with its time, tensor, owning layer, category and
        bytes, each step's compute span, the host-link copies and the peak. The recorder
        keeps the iteration with the highest peak; its ``snapshot()``, ``save_snapshot``,
        ``save_trace`` (Chrome / Perfetto) and ``save_plot`` (PNG) report it, as does
        :func:`minidl.analysis.memory_record.show_memory`::

            with trainer.record_memory() as rec:
                trainer.fit(data, epochs=1)
            rec.save_trace("run.json")
        """
        recorder = MemoryRecorder(self.net.name, self.config.spec, self.device.name,
                                  self.device.capacity, self.config.budget)
        with self.observed.recording_memory(recorder):
            yield recorder

    def memory_report(self) -> dict[str, Any]:
        """Peak allocated and reserved bytes, bytes by category at the peak, and where
        (:mod:`minidl.train.observation.memory_report`)."""
        return memory_report(self)

    def close(self) -> None:
        """Move parameters back to host memory and free the device pool's blocks."""
        if self.parallel is not None:
            self.parallel.close()
        self.engine.release()

