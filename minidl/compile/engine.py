"""The engine: a network, a loss, an optimizer and a memory spec on one device's pool.

It allocates the persistent state (parameters, gradients, optimizer state) once, lowers the
network per input shape into a program, asks the memory planner for a plan (cached per shape),
and runs it with the executor. The same engine on the meta device is the dry run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..kernels.parallel import ensure_blas_policy
from ..layers.base import Layer
from ..memory.cost.cost_model import step_costs, step_time
from ..memory.cost.targets import DeviceProfile
from ..memory.devices.device import MetaDevice
from ..memory.ir.config import MemoryConfig
from ..memory.ir.plan import Plan
from ..memory.ir.program import aligned
from ..memory.options import attention_options, bptt_options, workspace_options
from ..memory.passes.base_plan import plan_peak
from ..memory.planners.auto import BudgetTooSmall
from ..memory.planners.planner import make_plan
from ..memory.runtime.host_pool import HostPool
from ..memory.runtime.pool import Pool
from ..memory.runtime.transfer import copy_into, to_host
from ..net.graph import Network
from ..net.optim import FlatGroup, Optimizer
from .executor import Executor
from .lowering import Lowered, lower

#: Why a network with batch statistics is never split into micro-batches.
BATCH_STATS_SPLIT = ("batch splitting with BatchNorm would normalise with micro-batch statistics, "
                     "not the batch's: use a larger budget or device memory, or a smaller batch")


def micro_shapes(batch_shapes: list[tuple[int, ...]], label_shape: tuple[int, ...] | None,
                 micro: int) -> tuple[list[tuple[int, ...]], tuple[int, ...] | None]:
    """The same shapes with the batch dimension set to ``micro``."""
    shapes = [(micro, *s[1:]) for s in batch_shapes]
    return shapes, None if label_shape is None else (micro, *label_shape[1:])


@dataclass
class Compiled:
    lowered: Lowered
    plan: Plan
    executor: Executor
    notes: list[str] = field(default_factory=list)  # choices made before planning


@dataclass
class PeakInfo:
    """Where one iteration's allocated peak happened and what was live there."""

    bytes: int
    position: int
    step: str
    phase: str
    by_category: dict[str, int]
    live: list[tuple[str, str, int]]  # (tensor, category, bytes), largest first


class Engine:
    """Shared core of :class:`~minidl.Trainer` and the dry run (see module docstring)."""

    def __init__(
        self,
        net: Network,
        pool: Any,
        memory: str | MemoryConfig = "none",
        loss: Layer | None = None,
        optimizer: Any = None,
        bind: bool = True,
        host_memory: int | None = None,
        scratch_bytes: int | None = None,
        target: DeviceProfile | None = None,
    ) -> None:
        # BLAS single-threaded from the first product on (else the first step's products ran
        # on OpenBLAS's threads, cut by thread count, and the bits depended on it)
        ensure_blas_policy()
        self.net = net
        self.pool = pool
        self.host_pool = HostPool(pool.device, host_memory)
        self.config = MemoryConfig.parse(memory)
        self.loss = loss
        self.optimizer = optimizer
        self.compute = bool(getattr(pool.device, "has_storage", True))
        #: "cpu" or "cuda": what the program is lowered for (a meta device names its kind)
        self.device_kind = getattr(pool.device, "kind", "cpu")
        #: The device the plans are made for (its cost model's step times and host link drive
        #: swap=auto and auto), or ``None``: this device's measured times.
        self.target = target
        self.persistent_blocks: list[Any] = []
        #: The block reserved for the device library's own temporaries (CuPy's), sized from
        #: the first step's measured peak, or from ``scratch_bytes`` (a dry run for a GPU
        #: passes the measured figure to place every block as the GPU run will).
        self.scratch: Any = None
        self.params: list[Any] = []  # the network's parameters and buffers, bound in order
        self.opt_state_specs: list[tuple[str, tuple[int, ...], str]] = []
        #: ZeRO stage 2 and above (``zero=2``): the gradient shards allocated persistently,
        #: by the optimizer (:meth:`~minidl.distributed.zero.ZeroOptimizer.init_grads`), instead of
        #: every parameter's full gradient (then a block of the iteration); ``None`` below.
        self.grad_shard_specs: list[tuple[str, tuple[int, ...], str]] | None = \
            [] if self.config.zero >= 2 else None
        #: ZeRO stage 3 (``zero=3``, training): the parameter shards, likewise
        #: (:meth:`~minidl.distributed.zero.ZeroOptimizer.init_params`); the trainable parameters
        #: keep
        #: their host arrays and are gathered per step into blocks of the iteration.
        self.param_shard_specs: list[tuple[str, tuple[int, ...], str]] | None = \
            [] if self.config.zero >= 3 and loss is not None else None
        self._cache: dict[tuple, Compiled] = {}
        #: Under a budget no plan fits, cap convolutions' workspaces (leaner algorithms and
        #: chunking, :mod:`~minidl.memory.options.workspace_options`) and plan again.
        self.cap_workspaces = True
        #: Without a budget, the estimated step time vDNN's rule may add before the peak rises
        #: above the least-workspace plan's
        #: (:data:`~minidl.memory.options.workspace_options.TIME_SHARE`:
        #: ``inf``, vDNN's rule as it stands; ``0.02``: the lowest peak estimated within 2 %).
        self.workspace_time_share = workspace_options.TIME_SHARE
        self.bound = False
        self._allocate_persistent(bind, scratch_bytes)

    # ------------------------------------------------------------------ persistent state
    def _alloc(self, name: str, shape: tuple[int, ...], dtype: Any, category: str) -> Any:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        blk = self.pool.allocate(aligned(nbytes, self.pool.alignment), tag=name,
                                  category=category)
        self.persistent_blocks.append(blk)
        self._blocks[name] = blk
        return blk.view(tuple(shape), np.dtype(dtype))

    def _allocate_persistent(self, bind: bool, scratch_bytes: int | None = None) -> None:
        """Trainable parameters, then buffers, then gradients, then optimizer state slot by
        slot, each in layer order: the parameters, their gradients and each state slot are then
        laid out alike, back to back (one flat update per group: :meth:`_group_parameters`)."""
        self._blocks: dict[str, Any] = {}
        try:  # (everything on the device runs with it current: cuda:N)
            with getattr(self.pool.device, "activate", contextlib.nullcontext)():
                self._allocate_blocks(bind, scratch_bytes)
        except BaseException:
            self.release()
            raise

    def _allocate_blocks(self, bind: bool, scratch_bytes: int | None) -> None:
        params = self.params = [p for _, p in self.net.named_parameters(include_buffers=True)]
        views = {}
        for p in sorted(params, key=lambda q: not q.trainable):  # (a stable sort)
            sharded = self.param_shard_specs is not None and p.trainable
            views[id(p)] = None if sharded else self._alloc(p.name, p.shape, p.dtype,
                                                            "parameter")
        grads = []
        if self.loss is not None and self.grad_shard_specs is None:
            for p in params:
                if p.trainable:
                    grads.append((p, self._alloc(p.name + ".grad", p.shape, p.dtype,
                                                 "gradient")))
        if bind and self.compute:
            self.bound = True
            for p in params:
                v = views[id(p)]
                if v is not None:  # (zero=3: the host array stays, shards in the pool)
                    copy_into(v, p.data)  # the values, wherever they live
                    p.data = v
                p.bound_to = self
            for p, g in grads:
                g[...] = 0
                p.grad = g
        if self.optimizer is not None and self.loss is not None:

            def alloc_state(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
                arr = self._alloc(name, shape, dtype, "optimizer_state")
                if self.compute:
                    arr[...] = 0
                self.opt_state_specs.append((name, tuple(shape), np.dtype(dtype).name))
                return arr

            self._allocate_shards()
            self.optimizer.init_state(alloc_state)
            if self.bound:
                self._group_parameters()
        if scratch_bytes:
            self._reserve_scratch(scratch_bytes)

    def _group_parameters(self) -> None:
        """Hand the optimizer its parameters as :class:`~minidl.net.optim.FlatGroup` s: runs of
        parameters of one dtype whose blocks, gradients' blocks and state slots' blocks lie
        back to back with the same sizes. The bytes between them are zeroed (they take part
        in the flat update, and must stay finite)."""
        opt = self.optimizer
        if not isinstance(opt, Optimizer):
            return  # (ZeRO's wrapper shards the state: it updates its shards itself)
        blocks = self._blocks
        slots = opt.slots

        def chain(p: Any) -> list[Any] | None:
            names = [p.name, p.name + ".grad", *(f"{p.name}.{s}" for s in slots)]
            found = [blocks.get(n) for n in names]
            return found if all(found) and len({b.size for b in found}) == 1 else None

        runs: list[list[Any]] = []
        for p in opt.params:
            c = chain(p)
            if c is None or p.grad is None or p.bound_to is not self:
                runs.append([])
                continue
            run = runs[-1] if runs else []
            last = run[-1] if run else None
            if last is not None and last[0].dtype == p.dtype and all(
                    a.end == b.offset for a, b in zip(last[1], c)):
                run.append((p, c))
            else:
                runs.append([(p, c)])
        groups = []
        device = self.pool.device
        for run in runs:
            if len(run) < 2:
                continue
            dtype = np.dtype(run[0][0].dtype)
            first, last = run[0][1], run[-1][1]
            flats = [device.view(a.offset, b.end - a.offset, ((b.end - a.offset)
                                                              // dtype.itemsize,), dtype)
                     for a, b in zip(first, last)]
            base = first[0].offset
            for p, chain_ in run:  # zero the alignment bytes after each tensor
                lo = (chain_[0].offset - base) // dtype.itemsize + int(np.prod(p.shape))
                hi = (chain_[0].end - base) // dtype.itemsize
                if hi > lo:
                    for flat in flats:
                        flat[lo:hi] = 0
            groups.append(FlatGroup(tuple(p for p, _ in run), flats[0], flats[1],
                                    dict(zip(slots, flats[2:])),
                                    tuple((p.data, p.grad) for p, _ in run)))
        opt.flat_groups = groups

    def _allocate_shards(self) -> None:
        """ZeRO stages 2 and 3: the optimizer's parameter shards (their values copied from the
        parameters) and gradient shards (zeroed), through the pool."""
        if self.grad_shard_specs is None:
            return
        init_params = getattr(self.optimizer, "init_params", None)
        init_grads = getattr(self.optimizer, "init_grads", None)
        if init_grads is None:
            if self.compute:
                raise ValueError(f"zero={self.config.zero} trains with the optimizer wrapped in "
                                 "minidl.distributed.zero.ZeroOptimizer (as Trainer does), "
                                 "not a bare "
                                 f"{type(self.optimizer).__name__}")
            return  # a dry run: the rank's shards are accounted by memory.zero
        if self.param_shard_specs is not None:

            def alloc_param(name: str, shape: tuple[int, ...], dtype: Any, values: Any) -> Any:
                arr = self._alloc(name, shape, dtype, "parameter")
                if self.compute:
                    copy_into(arr, values)
                self.param_shard_specs.append((name, tuple(shape), np.dtype(dtype).name))
                return arr

            init_params(alloc_param)

        def alloc_grad(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            arr = self._alloc(name, shape, dtype, "gradient")
            if self.compute:
                arr[...] = 0
            self.grad_shard_specs.append((name, tuple(shape), np.dtype(dtype).name))
            return arr

        init_grads(alloc_grad)

    def release(self) -> None:
        """Return every persistent block to the pool; bound parameters move back to host arrays
        first, so the network stays usable."""
        if isinstance(self.optimizer, Optimizer):
            self.optimizer.flat_groups = []
        if self.bound:
            for p in self.params:
                if p.bound_to is not self:
                    continue  # another trainer took it over: its memory, not ours
                p.data = to_host(p.data)
                if p.grad is not None:
                    p.grad = to_host(p.grad)
                p.bound_to = None
            self.bound = False
        for blk in self.persistent_blocks:
            if not blk.freed:
                self.pool.free(blk)
        self.persistent_blocks.clear()
        self._cache.clear()

    # ------------------------------------------------------------------ compile
    def compiled(self, batch_shapes: list[tuple[int, ...]], label_shape: tuple[int, ...] | None,
                 training: bool, label_dtype: str = "int64",
                 accumulate: bool = False) -> Compiled:
        if self.bound and any(p.bound_to is not self for p in self.params):
            raise RuntimeError(
                f"the parameters of {self.net.name!r} were bound by another Trainer since this "
                "one was made: one network trains under one Trainer at a time (train with the "
                "newer Trainer, or make a new one)")
        key = (tuple(map(tuple, batch_shapes)), label_shape, training, label_dtype, accumulate)
        c = self._cache.get(key)
        if c is None:
            # inference has no backward: free every tensor after its last use
            config = self.config if training else MemoryConfig.parse("reuse,inplace")
            net = self.net.for_shapes(batch_shapes)  # the build for these shapes (T of RNNs)

            def lowered_with(options: dict | None) -> Lowered:
                return lower(net, list(batch_shapes), loss=self.loss, label_shape=label_shape,
                             label_dtype=label_dtype, training=training,
                             opt_state=self.opt_state_specs, accumulate_grads=accumulate,
                             alignment=self.pool.alignment, options=options,
                             device_kind=self.device_kind,
                             grad_shards=self.grad_shard_specs if training else None,
                             param_shards=self.param_shard_specs if training else None)

            first = lowered_with(None)
            # per-op options (fused RNNs' BPTT schedules, attention's memory forms): the
            # spec's, or under an auto budget the candidates, most kept first
            policies = bptt_options.policies(first.program, config)
            forms = attention_options.policies(first.program, config)
            choices = [(policy, form) for policy in policies for form in forms]
            for i, (policy, form) in enumerate(choices):
                options = workspace_options.merged(
                    bptt_options.options_for(first.program, policy),
                    attention_options.options_for(first.program, form))
                lowered = lowered_with(options) if options else first
                try:
                    lowered, plan = self._plan_fitting(lowered, options, lowered_with, config,
                                                       net)
                except BudgetTooSmall:
                    if i == len(choices) - 1:
                        raise
                    continue
                if len(policies) > 1:
                    plan = plan.with_notes(
                        f"recurrent layers' BPTT schedule {policy or 'keep all'} chosen to fit "
                        f"the budget ({len(policies)} candidates, most states first)")
                if len(forms) > 1:
                    plan = plan.with_notes(attention_options.describe(
                        lowered.program, form, forms.index(form) + 1))
                break
            c = self._compile(lowered, plan)
            c.notes = [n for n in plan.notes if n.startswith(
                ("recurrent layers", workspace_options.NOTE_PREFIX,
                 attention_options.NOTE_PREFIX))]
            self._cache[key] = c
        return c

    def _plan_fitting(self, lowered: Lowered, options: dict, lowered_with: Any,
                      config: MemoryConfig, net: Network) -> tuple[Lowered, Plan]:
        """The plan of ``lowered`` with convolutions' workspaces chosen by vDNN's rule, capped
        further when no plan fits the budget
        (:func:`~minidl.memory.options.workspace_options.plan_fitting`; ``net``'s layers give the
        convolutions' geometry for their estimated times). A swapping spec planned for a
        target (vDNN's policy) that does not fit the target's memory with its transfers timed
        by the cost model is planned again as vDNN schedules them, each prefetch a fixed
        number of steps ahead (compute waits for the copy), with memory-optimal workspaces
        where that is what fits (:meth:`_vdnn_fitting`)."""

        def plan_with(opts: dict | None, cfg: MemoryConfig) -> tuple[Lowered, Plan]:
            low = lowered if opts is None else lowered_with(opts)
            return low, make_plan(low.program, cfg, **self._target_costs(low))

        times = workspace_options.ConvTimes({i: node.layer for i, node in enumerate(net.nodes)},
                                            self.device_kind)
        low, plan = workspace_options.plan_fitting(lowered.program, options, config, plan_with,
                                                   self.cap_workspaces, times,
                                                   self.workspace_time_share, self._rule)
        capacity = self._swap_capacity(config)
        if capacity is None or self._reserved(plan) <= capacity:
            return low, plan
        return self._vdnn_fitting(lowered, options, lowered_with, config, times, capacity,
                                  (low, plan))

    @property
    def _rule(self) -> bool:
        """Whether vDNN's rule caps this engine's convolutions without a budget (its device
        kind in :data:`~minidl.memory.options.workspace_options.RULE_KINDS`)."""
        return self.device_kind in workspace_options.RULE_KINDS

    def _swap_capacity(self, config: MemoryConfig) -> int | None:
        """The target's memory, for a swapping spec without a search (``swap=conv|all``:
        vDNN's policy) planned for a target; else ``None``."""
        if self.target is None or config.get("swap") not in ("conv", "all") or \
                config.has("auto"):
            return None
        return self.target.capacity_bytes

    def _reserved(self, plan: Plan) -> int:
        """The bytes a run of ``plan`` reserves (the persistent state, the scratch block and
        the iteration's static arena), or without static offsets, allocates at its peak."""
        scratch = self.scratch.size if self.scratch is not None else 0
        arena = plan.static_arena if plan.static_arena >= 0 else plan_peak(plan)
        return plan.program.persistent_bytes() + scratch + arena

    def _vdnn_fitting(self, lowered: Lowered, options: dict, lowered_with: Any,
                      config: MemoryConfig, times: Any, capacity: int,
                      timed: tuple[Lowered, Plan]) -> tuple[Lowered, Plan]:
        """vDNN's policy within ``capacity``: prefetches a fixed number of steps ahead (no
        step times: :func:`~minidl.memory.passes.swap.swap_plan`'s lookahead), then convolutions'
        workspaces capped as under a budget of ``capacity``. ``timed`` (the plan that did not
        fit) when nothing does, with a note saying so."""
        need = self._reserved(timed[1])

        def plan_with(opts: dict | None, cfg: MemoryConfig) -> tuple[Lowered, Plan]:
            low = lowered if opts is None else lowered_with(opts)
            costs = {k: v for k, v in self._target_costs(low).items() if k != "step_times"}
            fitting = cfg.budget is not None  # the spec within capacity (not the canonical)
            cfg = MemoryConfig({k: v for k, v in cfg.flags.items() if k != "budget"})
            plan = make_plan(low.program, cfg, **costs)
            if fitting and self._reserved(plan) > capacity:
                raise BudgetTooSmall(f"{self._reserved(plan):,} B")
            return low, plan

        fit = MemoryConfig({**config.flags, "budget": str(capacity)})
        where = f"{self.target.name}'s {capacity:,} B"
        try:
            low, plan = workspace_options.plan_fitting(
                lowered.program, options, fit, plan_with, self.cap_workspaces, times,
                self.workspace_time_share, self._rule)
        except BudgetTooSmall as e:
            return timed[0], timed[1].with_notes(
                f"vDNN's policy: does not fit {where}, with the transfers timed by the cost "
                f"model ({need:,} B) nor with each prefetch a fixed number of steps ahead and "
                f"the least workspaces ({str(e).split(' (')[0]})")
        return low, plan.with_notes(
            f"vDNN's policy: each prefetch a fixed number of steps ahead, compute waiting for "
            f"its copy, to fit {where} (the transfers timed by the cost model needed "
            f"{need:,} B)")

    def _target_costs(self, lowered: Lowered) -> dict[str, Any]:
        """Step times and link rate from the target's cost model (none without a target)."""
        if self.target is None:
            return {}
        target = self.target
        return {"step_times": step_costs(lowered.program, target),
                "bandwidth": min(target.link_h2d_bytes_per_s, target.link_d2h_bytes_per_s),
                "cost_source": f"{target.name}'s cost model",
                "step_cost": lambda program, i: step_time(program, i, target)}

    def _compile(self, lowered: Lowered, plan: Plan) -> Compiled:
        """The executor for ``plan`` on this engine's pool, host pool and debug setting."""
        ex = Executor(lowered, plan, self.pool, compute=self.compute, host_pool=self.host_pool,
                      debug=getattr(self.pool, "debug", False))
        if self.scratch is not None:
            ex.scratch = (self.scratch.offset, self.scratch.size)
        return Compiled(lowered, plan, ex)

    def _reserve_scratch(self, nbytes: int) -> None:
        """A persistent block for the device library's temporaries, placed right after the
        other persistent blocks (where a dry run given the same size places it)."""
        blk = self.pool.allocate(aligned(nbytes, self.pool.alignment), tag="cupy.scratch",
                                 category="workspace")
        self.persistent_blocks.append(blk)
        self.scratch = blk
        self._cache.clear()  # static plans place blocks above the persistent ones

    def note_temporaries(self, executor: Executor) -> None:
        """After a measured step: reserve the scratch block from the temporaries' peak (once;
        until then they came from the pool itself)."""
        if self.scratch is None and executor.temp_peak > 0:
            self._reserve_scratch(executor.temp_peak)

    def split_for(self, batch_shapes: list[tuple[int, ...]], label_shape: tuple[int, ...] | None,
                  label_dtype: str = "int64", max_split: int = 64) -> int:
        """Micro-batches per batch: ``split=K`` when given; with ``auto``, the fewest (1, 2, 4,
        ...) whose plan fits the budget (moDNN's batch splitting) or, with a target, more while
        its cost model predicts a faster iteration.

        Training a network with batch statistics (BatchNorm) is never split: micro-batches would
        normalise with their own statistics; nor under ``zero=2`` (no full gradients persist
        to accumulate in). ``split=K`` then raises ``ValueError`` and ``auto`` plans the whole
        batch only (raising :class:`BudgetTooSmall` if that does not fit), so a
        dry run accepts exactly what training runs."""
        k = self.config.split
        batch_stats = bool(self.net.buffers())
        if k is not None and k > 1 and batch_stats:
            raise ValueError(BATCH_STATS_SPLIT)
        if k is not None and k > 1 and self.grad_shard_specs is not None:
            raise ValueError(f"split={k} accumulates every parameter's full gradient over the "
                             f"micro-batches, which zero={self.config.zero} does not keep: use "
                             "zero=1 with split, or zero=2 without")
        if k is not None or not self.config.has("auto"):
            return k or 1
        batch = batch_shapes[0][0]
        if batch_stats or self.grad_shard_specs is not None:
            why = BATCH_STATS_SPLIT if batch_stats else (
                f"zero={self.config.zero} keeps no full gradients to accumulate micro-batches in")
            try:
                self.compiled(batch_shapes, label_shape, True, label_dtype)
            except BudgetTooSmall as e:
                raise BudgetTooSmall(f"{e}; batch splitting was not tried: {why}") from None
            return 1
        k, last = 1, None
        while k <= min(max_split, batch):
            try:
                c = self.compiled(*micro_shapes(batch_shapes, label_shape, -(-batch // k)),
                                  True, label_dtype, accumulate=k > 1)
            except BudgetTooSmall as e:
                last = e
                k *= 2
                continue
            return self._faster_split(k, c, batch_shapes, label_shape, label_dtype,
                                      min(max_split, batch))
        raise last

    def _faster_split(self, k: int, c: Compiled, batch_shapes: list[tuple[int, ...]],
                      label_shape: tuple[int, ...] | None, label_dtype: str, most: int) -> int:
        """With a target, more micro-batches while the cost model predicts a shorter iteration
        (``k`` micro-batches whose plan swaps or recomputes can be slower than ``2k`` whose
        plans need neither); without one, ``k``."""
        if self.target is None:
            return k

        def iteration_s(c: Compiled, k: int) -> float:
            extra = c.plan.auto.extra_time_s if c.plan.auto is not None else 0.0
            return k * (sum(step_costs(c.lowered.program, self.target)) + extra)

        best = iteration_s(c, k)
        while best > 0 and c.plan.auto is not None and c.plan.auto.extra_time_s > 0 \
                and 2 * k <= most:
            try:
                c2 = self.compiled(*micro_shapes(batch_shapes, label_shape, -(-batch_shapes[0][0]
                                                                               // (2 * k))),
                                   True, label_dtype, accumulate=True)
            except BudgetTooSmall:
                break
            t2 = iteration_s(c2, 2 * k)
            if t2 >= best:
                break
            k, c, best = 2 * k, c2, t2
        return k

    def refine(self, c: Compiled) -> Compiled:
        """After a measured iteration, re-plan what depends on measurements: the tensors whose
        transfer hides under compute (``swap=auto``, ``auto``: Capuchin) and the sizes of
        sparse stashes (from the densities seen, with a 10% margin)."""
        need_times = (self.config.get("swap") == "auto" or self.config.has("auto")) \
            and not c.plan.measured and self.target is None  # a target's costs stand
        need_dens = self.config.has("sparse") and not c.plan.densities_measured \
            and bool(c.executor.densities)
        self.note_temporaries(c.executor)
        if self.scratch is not None and c.executor.scratch is None:
            return c  # the cache was cleared: the next step compiles with the scratch block
        if not (need_times or need_dens):
            return c
        times = list(c.executor.step_times) if need_times else None
        dens = {k: min(1.0, 1.1 * v + 1e-3) for k, v in c.executor.densities.items()}
        costs = self._target_costs(c.lowered)
        if times is not None:
            costs["step_times"] = times
            costs["cost_source"] = "measured step times"
            link = self._measured_link()
            if link is not None:
                costs["bandwidth"] = link
                costs["cost_source"] += " and host link"
        plan = make_plan(c.lowered.program, self.config, densities=dens, **costs)
        # choices made before planning (the BPTT schedule) stay in the notes
        plan = replace(plan, measured=plan.measured or need_times).with_notes(*c.notes)
        if need_times and not need_dens and any(
                new > old for new, old in zip(self._simulated_peaks(c.lowered, plan),
                                              self._simulated_peaks(c.lowered, c.plan))):
            # timing decisions must not raise the peak a dry run promised (it cannot measure):
            # a measured plan that would (more swaps, more fragmentation) is not taken
            plan = replace(c.plan, measured=True)
        new = self.replace_plan(c, plan)
        new.executor.densities = dict(c.executor.densities)
        return new

    def _measured_link(self) -> float | None:
        """Bytes per second the device's copy engine moved, timed by the device (a GPU's copy
        streams, CUDA events), once it has copied anything; ``None`` elsewhere (the CPU's copy
        thread is not the link a plan for it should assume)."""
        device = self.pool.device
        if not getattr(device, "asynchronous", False) or not self.compute:
            return None
        engine = device.copy_engine
        engine.synchronize()  # (once: a first iteration's re-planning)
        if engine.busy_s <= 0 or engine.total_bytes <= 0:
            return None
        return engine.total_bytes / engine.busy_s

    def replace_plan(self, c: Compiled, plan: Plan) -> Compiled:
        """A compiled step for ``plan`` (a new plan for ``c``'s program) taking ``c``'s place
        in the cache (plans are never changed in place)."""
        new = self._compile(c.lowered, plan)
        new.notes = list(c.notes)
        for k, v in self._cache.items():
            if v is c:
                self._cache[k] = new
        return new

    def _simulated_peaks(self, lowered: Lowered, plan: Plan) -> tuple[int, int]:
        """(reserved, allocated) peak bytes one iteration of ``plan`` reaches, placed on a
        meta pool holding this engine's persistent blocks, no compute."""
        pool = Pool(MetaDevice(), alignment=self.pool.alignment)
        for blk in self.persistent_blocks:
            pool.allocate(blk.size, tag=blk.tag, category="parameter")
        Executor(lowered, plan, pool, compute=False,
                 host_pool=HostPool(pool.device, None)).run([None] * len(plan.program.inputs))
        stats = pool.stats()
        return stats["reserved_bytes.peak"], stats["allocated_bytes.peak"]

    # ------------------------------------------------------------------ reports
    def peak_info(self, c: Compiled) -> PeakInfo:
        """Where the last run of ``c`` peaked, with the bytes live there by category."""
        rt = c.executor.last_runtime
        prog = c.plan.program
        if rt is None:
            raise RuntimeError("no iteration has run yet")
        by_cat: dict[str, int] = {}
        live: list[tuple[str, str, int]] = []
        tids = [t.id for t in prog.persistent]
        rt.snapshot_peak()
        tids += [t for t in rt.peak_live if t not in c.plan.aliases]
        for tid in tids:
            t = prog.tensors[tid]
            size = prog.block_size(t.nbytes)
            by_cat[t.category] = by_cat.get(t.category, 0) + size
            live.append((t.name, t.category, size))
        if self.scratch is not None:
            by_cat["workspace"] = by_cat.get("workspace", 0) + self.scratch.size
            live.append(("cupy.scratch", "workspace", self.scratch.size))
        live.sort(key=lambda r: -r[2])
        pos = rt.peak_position
        if 0 <= pos < len(prog.steps):
            st = prog.steps[pos]
            step, phase = st.layer, st.phase
        else:
            step, phase = ("(start)", "setup") if pos < 0 else ("(end)", "end")
        return PeakInfo(rt.peak_bytes, pos, step, phase, by_cat, live)
