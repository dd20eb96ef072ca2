"""The engine: a network, a loss, an optimizer and a memory spec on one device's pool.

It allocates the persistent state (parameters, gradients, optimizer state) once, lowers the
network per input shape into a program, asks the memory planner for a plan (cached per shape),
and runs it with the executor. The same engine on the meta device is the dry run.

The searches live beside it: the per-op options and workspace caps a plan is made with
(:mod:`~minidl.compile.option_search`), the micro-batches a batch runs as
(:mod:`~minidl.compile.split_search`) and re-planning from measurements
(:mod:`~minidl.compile.replanning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.parallel import ensure_blas_policy
from ..layers.base import Layer
from ..memory.cost.targets import DeviceProfile
from ..memory.devices.traits import device_traits
from ..memory.ir.config import MemoryConfig, OffloadPolicy
from ..memory.ir.plan import Plan
from ..memory.ir.precision import Precision
from ..memory.ir.program import aligned
from ..memory.options import workspace_options
from ..memory.planners.offload_choice import with_offload_if_needed
from ..memory.runtime.host_pool import HostMemoryExceeded, HostPool
from ..memory.runtime.transfer import copy_into, to_host
from ..net.graph import Network
from ..net.optim import FlatGroup, Optimizer
from . import replanning, split_search
from .chunked_upload import ChunkedUpload
from .compiled import Compiled
from .executor import Executor
from .host_state import HostState, half_parameters
from .lowering import Lowered, lower
from .option_search import choice_notes, search_options
from .shard_layout import ShardLayout, shard_layout, sharding_of
from .split_search import BATCH_STATS_SPLIT, micro_shapes

#: Names this module has always offered (some now live in the modules doing their job).
__all__ = ["BATCH_STATS_SPLIT", "Compiled", "Engine", "PeakInfo", "micro_shapes"]


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
        precision: Precision | str = Precision.FP32,
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
        traits = device_traits(pool.device)
        self.compute = traits.has_storage
        #: "cpu" or "cuda": what the program is lowered for (a meta device names its kind)
        self.device_kind = traits.kind
        #: The device the plans are made for (its cost model's step times and host link drive
        #: swap=auto and auto), or ``None``: this device's measured times.
        self.target = target
        #: What the programs are lowered in (:mod:`~minidl.memory.ir.precision`)
        self.precision = Precision.of(precision)
        self.persistent_blocks: list[Any] = []
        #: The block reserved for the device library's own temporaries (CuPy's), sized from
        #: the first step's measured peak, or from ``scratch_bytes`` (a dry run for a GPU
        #: passes the measured figure to place every block as the GPU run will).
        self.scratch: Any = None
        self.params: list[Any] = []  # the network's parameters and buffers, bound in order
        self.opt_state_specs: list[tuple[str, tuple[int, ...], str]] = []
        #: What this rank keeps of the persistent state: the layout of the spec's sharding
        #: stage, the optimizer's (:func:`~minidl.compile.shard_layout.shard_layout`).
        #: ``auto``'s note when it moved the persistent state to the host (else "").
        self.offload_note = ""
        if optimizer is not None and loss is not None:
            self.config, self.offload_note = with_offload_if_needed(
                self.config, *self._persistent_estimate(net, optimizer, pool.alignment,
                                                        self.precision))
        self.shards: ShardLayout = shard_layout(self.config.zero, optimizer, loss is not None)
        #: ``offload=optimizer``: the state kept on the host (gradients then lowered as
        #: tensors of the iteration, copied there by the plan), else ``None``.
        self.host_state: HostState | None = None
        #: Parameters the device keeps only as their half copy (offload in mixed precision)
        self.half_parameters: frozenset[str] = frozenset()
        if self.config.offload is not None and optimizer is not None and loss is not None:
            self.shards = ShardLayout.streamed() if self.streams \
                else ShardLayout.offloaded()
            updated = getattr(optimizer, "inner", optimizer).params
            self.half_parameters = half_parameters(net, self.precision) & {
                p.name for p in updated}
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

    @property
    def streams(self) -> bool:
        """``offload=parameters``: the trainable parameters are streamed in from the host."""
        return self.config.offload is OffloadPolicy.PARAMETERS

    # ------------------------------------------------------------------ persistent state
    @staticmethod
    def _persistent_estimate(net: Network, optimizer: Any, alignment: int,
                             precision: Precision) -> tuple[int, int, int]:
        """``(bytes, of them gradients and optimizer state, the parameters' bytes the device
        keeps under offload=optimizer)`` the persistent state would take on the device, in
        blocks of ``alignment``, before anything is allocated."""
        def block(shape: tuple[int, ...], dtype: Any) -> int:
            return aligned(int(np.prod(shape)) * np.dtype(dtype).itemsize, alignment)

        params = [p for _, p in net.named_parameters(include_buffers=True)]
        grads = sum(block(p.shape, p.dtype) for p in params if p.trainable)
        state = sum(block(shape, dtype) for _, shape, dtype in optimizer.state_spec())
        half = half_parameters(net, precision)
        kept = sum(block(p.shape, precision.half_dtype if p.name in half else p.dtype)
                   for p in params)
        return sum(block(p.shape, p.dtype) for p in params) + grads + state, grads + state, \
            kept

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
            with device_traits(self.pool.device).activate():
                self._allocate_blocks(bind, scratch_bytes)
        except BaseException:
            self.release()
            raise

    def _allocate_blocks(self, bind: bool, scratch_bytes: int | None) -> None:
        params = self.params = [p for _, p in self.net.named_parameters(include_buffers=True)]
        views = {}
        half = self.half_parameters
        for p in sorted(params, key=lambda q: not q.trainable):  # (a stable sort)
            whole = self.shards.keeps_whole(p)
            dtype = self.precision.half_dtype if p.name in half else p.dtype
            views[id(p)] = self._alloc(p.name, p.shape, dtype, "parameter") if whole else None
        #: The device's half copies (``data``: the host's master, bound by the host state)
        self.half_views = {p.name: views[id(p)] for p in params
                           if p.name in half and views[id(p)] is not None}
        grads = []
        if self.loss is not None and self.shards.gradient_specs is None:
            for p in params:
                if p.trainable:
                    grads.append((p, self._alloc(p.name + ".grad", p.shape, p.dtype,
                                                 "gradient")))
        if bind and self.compute:
            self.bound = True
            for p in params:
                v = views[id(p)]
                if v is not None and p.name not in half:  # (sharded: the host array stays,
                    # shards in the pool; a half copy: filled from the master on the host)
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

            self.shards.allocate_shards(self._alloc, self.compute)
            if self.config.offload is not None:
                self._offload_state()
            else:
                self.optimizer.init_state(alloc_state)
            if self.bound and self.host_state is None:
                self._group_parameters()
        if scratch_bytes:
            self._reserve_scratch(scratch_bytes)

    def _offload_state(self) -> None:
        """``offload=optimizer``: the optimizer's state, the master weights and the gradients
        in host memory (:class:`~minidl.compile.host_state.HostState`)."""
        opt = getattr(self.optimizer, "inner", self.optimizer)
        # (a sharding optimizer steps this rank's ranges, ``shard``, of ``owned``: the host
        # keeps their master weights and state only)
        owned = getattr(self.optimizer, "owned", None)
        stepper = opt if owned is None else self.optimizer.shard
        self.host_state = HostState(self.pool.device, list(opt.params), tuple(opt.slots),
                                    self.pool.alignment, allocate=self.bound,
                                    half_copies=self.half_views,
                                    streamed=self.half_parameters if self.streams else None,
                                    half_dtype=self.precision.half_dtype, owned=owned,
                                    shard_gradients=self.config.zero >= 2)
        if self.streams:  # (inference reads the host's half copies)
            self.half_views = dict(self.host_state.half_copies)
        capacity = self.host_pool.capacity
        if capacity is not None:
            if self.host_state.nbytes > capacity:
                raise HostMemoryExceeded(
                    f"offload=optimizer keeps {self.host_state.nbytes:,} B of state on the host "
                    f"but the host memory bound is {capacity:,} B; raise --host-memory")
            self.host_pool.capacity = capacity - self.host_state.nbytes
        stepper.init_state(self.host_state.alloc_state)
        if self.bound:
            self.host_state.bind(stepper)
            self.host_state.chunks = ChunkedUpload(
                self.host_state, {n: b.offset for n, b in self._blocks.items()})

    def _group_parameters(self) -> None:
        """Hand the optimizer its parameters as :class:`~minidl.net.optim.FlatGroup` s: runs of
        parameters of one dtype whose blocks, gradients' blocks and state slots' blocks lie
        back to back with the same sizes. The bytes between them are zeroed (they take part
        in the flat update, and must stay finite)."""
        opt = self.optimizer
        if not isinstance(opt, Optimizer):
            return  # (a wrapper sharding the state updates its shards itself)
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
        """The compiled step for these shapes (lowered, planned and cached on first use);
        ``accumulate``: gradients add into ``.grad`` (a micro-batch of a split batch)."""
        if self.bound and any(p.bound_to is not self for p in self.params):
            raise RuntimeError(
                f"the parameters of {self.net.name!r} were bound by another Trainer since this "
                "one was made: one network trains under one Trainer at a time (train with the "
                "newer Trainer, or make a new one)")
        if accumulate and training and self.host_state is not None:
            raise ValueError("offload=optimizer copies each gradient to the host as backward "
                             "writes it: gradients cannot accumulate on the device over "
                             "micro-batches (split, accumulate_grad_batches); drop one")
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
                             sharding=sharding_of(self.shards) if training else None,
                             precision=self.precision, half_parameters=self.half_parameters)

            lowered, plan = search_options(self, lowered_with(None), lowered_with, config)
            if self.offload_note and training:
                plan = plan.with_notes(self.offload_note, first=True)
            c = self._compile(lowered, plan)
            c.notes = choice_notes(plan)
            self._cache[key] = c
        return c

    def _compile(self, lowered: Lowered, plan: Plan) -> Compiled:
        """The executor for ``plan`` on this engine's pool, host pool and debug setting."""
        ex = Executor(lowered, plan, self.pool, compute=self.compute, host_pool=self.host_pool,
                      debug=getattr(self.pool, "debug", False))
        if self.scratch is not None:
            ex.scratch = (self.scratch.offset, self.scratch.size)
        if self.host_state is not None:
            ex.host_homes = self.host_state.homes(plan.program)
        if self.bound:
            ex.device_params = {lowered.param_tensors[n]: v for n, v in self.half_views.items()
                                if n in lowered.param_tensors}
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
        its cost model predicts a faster iteration (:mod:`~minidl.compile.split_search`).

        Training a network with batch statistics (BatchNorm) is never split: micro-batches would
        normalise with their own statistics; nor under ``zero=2`` (no full gradients persist
        to accumulate in). ``split=K`` then raises ``ValueError`` and ``auto`` plans the whole
        batch only (raising :class:`BudgetTooSmall` if that does not fit), so a
        dry run accepts exactly what training runs."""
        return split_search.split_for(self, batch_shapes, label_shape, label_dtype, max_split)

    def refine(self, c: Compiled) -> Compiled:
        """After a measured iteration, re-plan what depends on measurements: the tensors whose
        transfer hides under compute (``swap=auto``, ``auto``: Capuchin) and the sizes of
        sparse stashes (from the densities seen, with a 10% margin;
        :mod:`~minidl.compile.replanning`)."""
        return replanning.refine(self, c)

    def replace_plan(self, c: Compiled, plan: Plan) -> Compiled:
        """A compiled step for ``plan`` (a new plan for ``c``'s program) taking ``c``'s place
        in the cache (plans are never changed in place)."""
        new = self._compile(c.lowered, plan)
        new.notes = list(c.notes)
        for k, v in self._cache.items():
            if v is c:
                self._cache[k] = new
        return new

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
        rt.peak.snapshot(rt.records)
        tids += [t for t in rt.peak.live if t not in c.plan.aliases]
        for tid in tids:
            t = prog.tensors[tid]
            size = prog.block_size(t.nbytes)
            by_cat[t.category] = by_cat.get(t.category, 0) + size
            live.append((t.name, t.category, size))
        if self.scratch is not None:
            by_cat["workspace"] = by_cat.get("workspace", 0) + self.scratch.size
            live.append(("cupy.scratch", "workspace", self.scratch.size))
        live.sort(key=lambda r: -r[2])
        pos = rt.peak.position
        if 0 <= pos < len(prog.steps):
            st = prog.steps[pos]
            step, phase = st.layer, st.phase
        else:
            step, phase = ("(start)", "setup") if pos < 0 else ("(end)", "end")
        return PeakInfo(rt.peak.bytes, pos, step, phase, by_cat, live)
