"""The executor: walks a plan, memory actions through the runtime, compute through the layers."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..kernels.pointwise.add import add as add_arrays
from ..layers.base import Context
from ..memory.devices.traits import device_traits
from ..memory.ir.names import Codec, Phase, Role
from ..memory.ir.plan import Plan
from ..memory.ir.precision import is_float
from ..memory.ir.program import Step
from ..memory.ir.walk import Where, walk
from ..memory.passes import codecs
from ..memory.runtime.runtime import MemoryRuntime, tensor_info
from ..memory.runtime.scratch import TemporaryRouter
from ..memory.runtime.transfer import copy_into, fetch_async
from . import mixed_steps
from .hooks import StepHooks
from .lowering import Lowered


class NonFiniteError(FloatingPointError):
    """NaN or inf appeared in a layer's output or in the loss."""


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a cheap bijective scramble of 64-bit integers."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, iteration: int, node: int) -> int:
    """The reproducible per-(layer, iteration) seed handed to layers (dropout masks): the same
    for a recomputed forward, different for every layer and iteration."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ iteration) ^ node) >> 1


@dataclass(frozen=True)
class _RunSettings:
    """What one run was asked: what its layers are told (training, per-layer seeds, whether
    the forward recomputes, the loss scale backward starts from) and what it checks and
    fetches."""

    training: bool
    seed: int
    iteration: int
    recomputing: bool
    loss_scale: float
    fetch_outputs: bool
    check_finite: bool


@dataclass
class _Fetched:
    """What one run fetched: the network outputs asked for, and the loss."""

    outputs: list[Any] = field(default_factory=list)
    loss: Any = None


@dataclass
class _Run:
    """One run's settings, handed along its steps, and what it fetched."""

    rt: MemoryRuntime
    settings: _RunSettings
    hooks: StepHooks | None
    #: The hooks' ``before_step`` (``None``: nothing before the steps).
    before_step: Any = None
    #: The device's step timer (``None``: steps timed on the host).
    timer: Any = None
    fetched: _Fetched = field(default_factory=_Fetched)


class Executor:
    """Runs one lowered program under one plan on a pool.

    With ``compute=False`` (the meta device) only the memory actions run: the pool places every
    block exactly as in a real run, so the dry-run peak equals the real-run peak.
    """

    def __init__(self, lowered: Lowered, plan: Plan, pool: Any, compute: bool = True,
                 host_pool: Any = None, debug: bool = False) -> None:
        self.lowered = lowered
        self.plan = plan
        self.pool = pool
        #: What the pool's device can do (its step timer, upload, activation, allocator
        #: routing), read once.
        self.device = device_traits(pool.device)
        self.host_pool = host_pool
        self.debug = debug
        self.compute = compute
        self.last_runtime: MemoryRuntime | None = None
        self.steps = plan.program.steps
        self.tensor_info = tensor_info(plan.program)
        self.layers = lowered.layers
        #: Parameter tensors -> their Parameter (a recomputation's copy of a parameter of the
        #: iteration is its original's)
        self.parameters = {**lowered.parameters, **{
            t.id: lowered.parameters[t.of] for t in plan.program.tensors
            if t.of in lowered.parameters and t.role == Role.PARAM}}
        self.outputs = set(lowered.output_tensors)
        self.codec_state: dict[int, codecs.CodecState] = {}
        #: Largest fraction of non-zeros seen per sparse-encoded tensor (for re-planning).
        self.densities: dict[str, float] = {}
        self._step_times = np.zeros(len(self.steps))
        #: Iterations run to the end (the first compiles kernels: its times are no measure).
        self.runs = 0
        self._timer: Any = None  # a device's step timer, read when the times are asked for
        #: Device seconds of the whole last iteration (CUDA events: the compute stream's waits
        #: for copies and for the host included), once read; ``None`` on host devices.
        self.iteration_s: float | None = None
        #: (offset, bytes) of the block reserved for the device library's own temporaries
        #: (CuPy's): set by the engine once measured; ``None`` routes them into the pool.
        self.scratch: tuple[int, int] | None = None
        #: The last run's temporaries (:class:`~minidl.memory.runtime.scratch.TemporaryRouter`:
        #: their
        #: footprint, live peak and overflow of the scratch block); ``None`` on the CPU.
        self.temporaries: TemporaryRouter | None = None
        #: Host buffers offloaded gradients land in, by tensor (``offload=optimizer``).
        self.host_homes: dict[int, Any] | None = None
        #: Device arrays of parameters whose :class:`Parameter` ``data`` is elsewhere, by
        #: tensor (``offload=optimizer`` in mixed precision: the half copy on the device, the
        #: float32 master on the host).
        self.device_params: dict[int, Any] = {}
        self._feed_checks = self._feed_consumers()
        #: Steps of a mixed-precision program that touch half tensors (by id): they run
        #: through :mod:`.mixed_steps` (empty in float32).
        dtypes = [np.dtype(t.dtype) for t in plan.program.tensors]
        self._mixed = frozenset(id(st) for st in self.steps
                                if mixed_steps.runs_mixed(st, dtypes))
        #: The plan's walk (:func:`~minidl.memory.ir.walk.walk`), computed once: every run
        #: replays it.
        self._visits = tuple(walk(plan))
        #: The first backward (or recomputing) step: what is on device then is what the
        #: forward pass kept for backward (-1: none).
        self._backward_starts = next((i for i, st in enumerate(self.steps)
                                      if st.phase in (Phase.BACKWARD, Phase.RECOMPUTE)), -1)

    @property
    def step_times(self) -> np.ndarray:
        """Seconds of each step in the last run: host time on the CPU, device time from CUDA
        events on a GPU (reading them waits for the run's last event if it has not passed)."""
        if self._timer is not None:
            timer, self._timer = self._timer, None
            self._step_times[:] = timer.collect()
            self.iteration_s = getattr(timer, "iteration_s", None)
        return self._step_times

    @property
    def temp_peak(self) -> int:
        """Bytes a scratch block needs for the last run's temporaries (0 without any)."""
        return 0 if self.temporaries is None else self.temporaries.footprint

    def _feed_consumers(self) -> list[list[tuple[Any, int, list[tuple[int, ...]]]]]:
        """Per program input, (layer, input index, the step's input shapes) of every forward
        step reading it."""
        prog = self.plan.program
        where = {tid: k for k, tid in enumerate(prog.inputs)}
        out: list[list[tuple[Any, int, list[tuple[int, ...]]]]] = [[] for _ in prog.inputs]
        for st in prog.steps:
            if st.phase == Phase.FORWARD and st.node >= 0:
                shapes = [tuple(prog.tensors[t].shape) for t in st.forward.inputs]
                for j, tid in enumerate(st.forward.inputs):
                    if tid in where:
                        out[where[tid]].append((self.layers[st.node], j, shapes))
        return out

    def _step_timer(self) -> Any:
        """The device's step timer for a run that computes (``None``: time on the host)."""
        make_timer = self.device.step_timer
        return make_timer(len(self.plan.steps)) if self.compute and make_timer is not None \
            else None

    def _before_step(self, hooks: StepHooks | None) -> Any:
        """The hooks' ``before_step`` (``None`` without hooks, without one, or without
        compute)."""
        if hooks is None or not self.compute:
            return None
        return hooks.before_step

    def device_scope(self, measure: bool = False) -> Any:
        """The device context the run's work needs: the device current (``cuda:N``) and the
        device library's temporaries routed into the arena (into the scratch block when one is
        reserved, else into the pool; ``measure=True`` starts a new measurement in
        :attr:`temporaries`). The trainer runs the optimizer's update in it too."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.device.activate())
        route = self.device.route_allocations
        if route is not None and self.compute:
            if measure or self.temporaries is None:
                self.temporaries = TemporaryRouter(self.pool, self.scratch)
            stack.enter_context(route(self.temporaries.allocate))
        return stack

    def run(
        self,
        feeds: list[np.ndarray],
        training: bool = True,
        seed: int = 0,
        iteration: int = 0,
        fetch_outputs: bool = False,
        check_finite: bool = False,
        recomputing: bool = False,
        loss_scale: float = 1.0,
        record: bool = False,
        hooks: StepHooks | None = None,
        wait: bool = True,
    ) -> tuple[Any, list[Any]]:
        """Run every step. Returns the loss (if the program has one) and, if asked, copies of
        the network outputs. On any error every block of the iteration is freed.
        ``wait=False`` on a device that runs asynchronously (a GPU): the loss and outputs come
        back as pending host copies (``ready()`` / ``result()``,
        :func:`~minidl.memory.runtime.transfer.fetch_async`) and the host does not wait for the
        device; elsewhere they are values as with ``wait=True``.
        ``hooks`` (:class:`~.hooks.StepHooks`, e.g. data parallelism): ``before_step(self,
        i)`` before each step ``i`` when it has one, ``after_backward_step(self, i)`` after
        each backward step ``i``, and its ``batch_sync`` goes to the layers."""
        prog = self.plan.program
        rt = MemoryRuntime(self.pool, prog, self.plan, self.host_pool,
                           poison_offloaded=self.debug, info=self.tensor_info,
                           host_homes=self.host_homes)
        self.last_runtime = rt
        if record:
            rt.start_recording()
        settings = _RunSettings(training, seed, iteration, recomputing, loss_scale,
                                fetch_outputs, check_finite)
        state = _Run(rt, settings, hooks, before_step=self._before_step(hooks))
        try:
            with self.device_scope(measure=True):
                self._run_steps(state, feeds)
        except BaseException:
            rt.release_all()
            raise
        self.runs += 1
        loss, outputs = state.fetched.loss, state.fetched.outputs
        if wait:
            loss = None if loss is None else float(loss.result()[()])
            outputs = [o.result() for o in outputs]
        return loss, outputs

    def _run_steps(self, run: _Run, feeds: list) -> None:
        """Walk the plan (its visits, computed once): memory actions through the runtime,
        feeds after ``begin``, each step's compute between its ``before`` and ``after``."""
        rt = run.rt
        compute = self.compute
        steps = self.steps
        kept_at = self._backward_starts
        run.timer = self._step_timer()  # (made in the device's scope: its events are there)
        self._timer = None
        if run.timer is not None:
            run.timer.begin()
        for visit in self._visits:
            where = visit.where
            if where is Where.COMPUTE:
                if compute:
                    self._compute(visit.step, steps[visit.step], run)
                continue
            if where is Where.BEFORE and visit.step == kept_at:
                rt.note_kept_for_backward()
            rt.run_visit(visit)
            if where is Where.BEGIN and compute:
                self._load_feeds(rt, feeds)
        if run.timer is not None:
            run.timer.end()
            self._timer = run.timer

    def _load_feeds(self, rt: MemoryRuntime, feeds: list) -> None:
        """Copy the program's inputs into their blocks."""
        upload = self.device.copy_from_host
        for k, (tid, x) in enumerate(zip(self.plan.program.inputs, feeds)):
            dst = rt.array(tid)
            host = np.asarray(x).astype(dst.dtype, casting="same_kind", copy=False)
            if upload is None:
                copy_into(dst, host)
            else:  # a GPU: checked here (the layers' checks would wait for the device),
                for layer, j, shapes in self._feed_checks[k]:  # then sent asynchronously
                    layer.check_feed(j, host, shapes)
                upload(dst, host)

    def _compute(self, i: int, st: Step, run: _Run) -> None:
        """Step ``i``'s compute, timed (host time, or the device's step timer): parameters
        the hooks' ``before_step`` before it, their ``after_backward_step`` after a backward
        step."""
        if run.before_step is not None:
            run.before_step(self, i)
        timer = run.timer
        if timer is None:
            t0 = time.perf_counter()
        else:
            timer.start(i)
        self._run_step(st, run)
        if timer is None:
            self._step_times[i] = time.perf_counter() - t0
        else:
            timer.stop(i)
        if run.hooks is not None and st.phase == Phase.BACKWARD:
            run.hooks.after_backward_step(self, i)

    def _run_step(self, st: Step, run: _Run) -> None:
        """The work of one step, by phase."""
        rt = run.rt
        hooks = run.hooks
        told = run.settings
        ctx = None if st.node < 0 else Context(
            training=told.training, seed=step_seed(told.seed, told.iteration, st.node),
            recomputing=told.recomputing or st.phase == Phase.RECOMPUTE,
            accumulate=st.backward.accumulate, options=st.op.options.as_layer_options,
            batch_sync=None if hooks is None else hooks.batch_sync)
        if st.phase == Phase.ENCODE:
            self._encode(st, rt)
        elif st.phase == Phase.DECODE:
            work = st.op.codec
            codecs.decode(work.codec, rt.array(st.access.reads[0]), rt.array(st.access.writes[0]),
                          self.codec_state.get(work.source) or codecs.CodecState())
        elif st.phase == Phase.RECOMPUTE:
            self._forward(st, rt, ctx)
        elif st.phase == Phase.FORWARD:
            self._forward(st, rt, ctx)
            self._after_forward(st, run)
        else:
            self._backward(st, rt, ctx, told.loss_scale)

    def _after_forward(self, st: Step, run: _Run) -> None:
        """A forward step's outputs checked (``check_finite``), fetched (``fetch_outputs``),
        and the loss fetched from the step that writes it."""
        rt = run.rt
        device = self.pool.device
        if run.settings.check_finite:
            self._check(st, rt)
        if run.settings.fetch_outputs:
            run.fetched.outputs += [fetch_async(device, rt.array(t)) for t in st.forward.outputs
                                    if t in self.outputs]
        loss = self.plan.program.loss
        if loss >= 0 and st.forward.outputs[0] == loss:
            run.fetched.loss = fetch_async(device, rt.array(loss))

    def _encode(self, st: Step, rt: MemoryRuntime) -> None:
        codec, src = st.op.codec.codec, st.op.codec.source
        x = rt.array(src)
        out = st.access.writes[0]
        state = self.codec_state.get(src)
        if state is None:
            window = st.op.codec.window
            state = self.codec_state[src] = codecs.CodecState(
                window=0 if window is None else window.size)
        need = codecs.encode(codec, x, rt.array(out), state)
        if codec == Codec.SPARSE:  # (the count the encoder read: no second pass over x)
            name = rt.program.tensors[src].name
            density = state.nnz / max(int(x.size), 1)
            self.densities[name] = max(self.densities.get(name, 0.0), density)
        if need > rt.array(out).size:
            # denser than planned: a larger block for this iteration (the plan is refined
            # from the measured densities after the first iteration)
            rt.realloc(out, need)
            codecs.encode(codec, x, rt.array(out), state)

    def _params(self, st: Step, rt: MemoryRuntime) -> dict[str, Any]:
        """The step's parameters: a :class:`Parameter`'s array, or a block of the iteration
        for a parameter the program materialises itself (decoded from a compressed model, or
        under ZeRO stage 3 gathered from the ranks' shards just before the step)."""
        tensors, own = rt.program.tensors, self.device_params
        return {k: own[t] if t in own else self.parameters[t].data
                if t in self.parameters and tensors[t].persistent
                else rt.array(t) for k, t in st.forward.params.items()}

    def _forward(self, st: Step, rt: MemoryRuntime, ctx: Context) -> None:
        arr = rt.array
        layer = self.layers[st.node]
        args = ([arr(t) for t in st.forward.inputs], [arr(t) for t in st.forward.outputs],
                self._params(st, rt), {k: arr(t) for k, t in st.forward.stash.items()},
                arr(st.access.workspace) if st.access.workspace >= 0 else None)
        if id(st) in self._mixed:
            mixed_steps.forward(layer, ctx, st, *args)
        else:
            layer.forward(ctx, *args)

    def _backward(self, st: Step, rt: MemoryRuntime, ctx: Context,
                  loss_scale: float = 1.0) -> None:
        arr = rt.array
        layer = self.layers[st.node]
        encoded = st.op.from_encoded
        if encoded is not None:  # the stash is kept encoded: backward starts from it
            g = st.backward.grad_inputs[0]
            if g is not None:
                dx = arr(g.written)
                args = (encoded.encoding, arr(encoded.tensor),
                        arr(st.backward.grad_outputs[0]), dx)
                if id(st) in self._mixed:
                    ws = arr(st.access.workspace) if st.access.workspace >= 0 else None
                    mixed_steps.backward_from_encoded(layer, *args, ws)
                else:
                    layer.backward_from_encoded(*args)
                if g.add_into >= 0:
                    add_arrays(arr(g.add_into), dx, arr(g.add_into))
            return
        g_out = []
        for t in st.backward.grad_outputs:
            g = arr(t)
            role = rt.program.tensors[t].role
            if role == Role.SEED:
                g.fill(loss_scale)
            elif role == Role.ZEROS:
                g.fill(0.0)
            g_out.append(g)
        mixed = id(st) in self._mixed  # (a cast copy in its stash stands for a kept input)
        retained = st.backward.retained_inputs if mixed else layer.retain_inputs
        inputs = [arr(t) if j in retained else None for j, t in enumerate(st.forward.inputs)]
        outputs = [arr(t) if j in layer.retain_outputs else None
                   for j, t in enumerate(st.forward.outputs)]
        g_in = [None if g is None else arr(g.written) for g in st.backward.grad_inputs]
        grads = {k: arr(st.backward.param_partials[k]) if k in st.backward.param_partials
                 else self._param_grad(st, k, rt) for k in st.backward.grad_params}
        stash = {k: arr(t) for k, t in st.forward.stash.items()}
        ws = arr(st.access.workspace) if st.access.workspace >= 0 else None
        if mixed:
            mixed_steps.backward(layer, ctx, st, g_out, g_in, inputs, outputs,
                                 self._params(st, rt), grads, stash, ws,
                                 [rt.program.tensors[t].shape for t in st.forward.inputs])
        else:
            layer.backward(ctx, g_out, g_in, inputs, outputs, self._params(st, rt), grads,
                           stash, ws)
        for g in st.backward.grad_inputs:
            if g is not None and g.add_into >= 0:
                target = arr(g.add_into)
                add_arrays(target, arr(g.written), target)
        for k, t in st.backward.param_partials.items():
            grad = self._param_grad(st, k, rt)
            add_arrays(grad, arr(t), grad)

    def _param_grad(self, st: Step, k: str, rt: MemoryRuntime) -> Any:
        """Parameter ``k``'s gradient: its persistent ``.grad``, or under ZeRO stage 2 a block
        of the iteration (``zero=2``: handed to its bucket after its last write)."""
        tid = st.backward.grad_params[k]
        if rt.program.tensors[tid].persistent:
            return self.parameters[st.forward.params[k]].grad
        return rt.array(tid)

    def _check(self, st: Step, rt: MemoryRuntime) -> None:
        for t in st.forward.outputs:
            a = rt.array(t)
            if is_float(a.dtype) and not np.isfinite(a).all():
                raise NonFiniteError(
                    f"non-finite values (NaN or inf) first appear in the output of layer "
                    f"{st.layer} ({self.layers[st.node].describe()})"
                )
