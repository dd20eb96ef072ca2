"""ZeRO in training (Rajbhandari et al., 2020): ``zero=1``, ``zero=2`` and ``zero=3``.

Each data-parallel rank owns one range of the trainable parameters flattened in order: the
ranges are :func:`minidl.memory.passes.zero.owned_ranges` (the planner's accounting uses the same
function). :class:`ZeroOptimizer` wraps the user's optimizer: an optimizer of the same class
and hyperparameters runs over :class:`ShardParameter` slices (1-D views of the owned elements
of ``.data``), so its state, allocated by the engine through ``init_state``, is this rank's
share only; after the update the ranks all-gather the parameters (through host buffers of the
parameters' size outside the device pool, as the gradient buckets are).

* **Stage 1** (optimizer state sharded): the gradients are all-reduced whole into every
  parameter's persistent ``.grad``; a shard's gradient is a view of it.
* **Stage 2** (also gradients): each shard has its own persistent gradient block in the pool
  (allocated by the engine through :class:`ZeroShardLayout`), and no parameter keeps a full
  gradient: the engine lowers the full gradients as blocks of the iteration, which the
  executor frees after their last write, once
  :class:`~minidl.distributed.data_parallel.GradientSync`
  has copied them into their bucket's host buffer. Buckets are reduce-scattered
  (``Communicator.reduce_scatter_v``, each rank receiving the part of the bucket it owns)
  straight into the shards' gradients. ``.grad`` of the network's parameters is then
  ``None``; gradient clipping goes through :meth:`ZeroOptimizer.clip_grad_norm` (the norm
  summed over the ranks). Micro-batch splitting (``split=K``) needs the full gradients to
  accumulate in, so it is refused from stage 2 on.
* **Stage 3** (also parameters): each shard's values are a persistent block of their own
  (:class:`ZeroShardLayout`) and the pool holds no full trainable parameter between
  steps. The engine lowers every step that reads a trainable parameter (forward, backward)
  with a block of its own for it, allocated just before the step and freed after its last
  use (a recomputation reuses its forward's); :class:`LayerGather`, called by the executor
  before each step, fills the blocks that step first uses with an all-gather of the ranks'
  shards. The parameters' host arrays (outside the pool) are refreshed by the all-gather
  after each update: evaluation, checkpoints and the next run read them. Every rank needs
  rows in every batch (each joins every gather).

Under ``none`` (network-wide allocation: every block of the iteration lives to its end) the
full gradients and gathered parameters live to the end of the iteration too, so stages 2 and 3
save memory at the peak only with a liveness spec (``reuse`` and the ones implying it).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np

from ..memory.passes.zero import owned_ranges
from ..memory.runtime.transfer import copy_into
from ..net.optim import Optimizer, OptimizerWrapper, clip_grad_norm_, scale_to_norm
from ..net.parameter import Parameter
from .comm import Communicator


class ShardParameter(Parameter):
    """Elements ``[lo, hi)`` of ``base``'s flattened ``data`` and ``grad``, as a 1-D parameter
    (views, taken anew at each access: ``base`` may be rebound to the device pool). Under
    stage 2 the shard's gradient is an array of its own (``own_grad``) instead, under stage 3
    also its values (``own_data``)."""

    __slots__ = ("base", "lo", "hi", "own_grad", "own_data")

    def __init__(self, base: Parameter, lo: int, hi: int) -> None:
        self.base, self.lo, self.hi = base, lo, hi
        self.own_grad: Any = None
        self.own_data: Any = None
        super().__init__(f"{base.name}[{lo}:{hi}]", None)

    @property
    def data(self) -> Any:
        if self.own_data is not None:
            return self.own_data
        return self.base.data.reshape(-1)[self.lo:self.hi]

    @data.setter
    def data(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a shard's data is a view of its parameter's")

    @property
    def grad(self) -> Any:
        if self.own_grad is not None:
            return self.own_grad
        g = self.base.grad
        return None if g is None else g.reshape(-1)[self.lo:self.hi]

    @grad.setter
    def grad(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a shard's gradient is a view of its parameter's")


class ZeroOptimizer(OptimizerWrapper):
    """``inner`` (the user's optimizer, whose ``lr`` a scheduler may set) with its state and
    updates (``stage`` 2: also its gradients) sharded over the ranks of ``comm``; see the
    module docstring."""

    def __init__(self, inner: Optimizer, comm: Communicator, stage: int = 1) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeroOptimizer trains ZeRO stage 1, 2 or 3, got {stage}")
        self.inner = inner
        self.comm = comm
        self.stage = stage
        params = inner.params
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"zero={stage} shards one flat range of the parameters: they must "
                             f"share a dtype, got {sorted(map(str, dtypes))}")
        self.sizes = [int(np.prod(p.shape)) for p in params]
        #: ``(parameter index, lo, hi)``: the ranges of ``inner.params`` this rank owns
        owned = self.owned = owned_ranges(self.sizes, comm.size, comm.rank)
        self.shard = copy.copy(inner)  # same class and hyperparameters, other parameters
        Optimizer.__init__(self.shard, [ShardParameter(params[i], lo, hi)
                                        for i, lo, hi in owned], inner.lr)
        self.shard_elements = -(-sum(self.sizes) // comm.size)
        dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        self._send = np.zeros(self.shard_elements, dtype=dtype)
        self._recv = np.empty(self.shard_elements * comm.size, dtype=dtype)

    def state_spec(self) -> list:
        return self.shard.state_spec()

    def init_state(self, alloc: Any) -> None:
        """Allocate this rank's share of the state through ``alloc`` (the engine's pool)."""
        self.shard.init_state(alloc)

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank keeps only its shards' gradients (stage 2)."""
        return self.stage >= 2

    def grad_spec(self) -> list[tuple[str, tuple[int, ...], np.dtype]]:
        """Stage 2: ``(name, shape, dtype)`` of the gradient block of each owned range."""
        if self.stage < 2:
            return []
        return [(f"{p.base.name}.grad[{p.lo}:{p.hi}]", (p.hi - p.lo,), p.base.dtype)
                for p in self.shard.params]

    def shard_layout(self, training: bool) -> ZeroShardLayout:
        """What this rank keeps of the persistent state, for the engine (stages 2 and 3;
        ``training``: an engine with a loss)."""
        return ZeroShardLayout(self, training)

    def params_changed(self) -> None:
        """The parameters' (host) values were set from outside (broadcast from rank 0, a
        checkpoint loaded): stage 3 copies the owned ranges into the shards."""
        if self.stage < 3:
            return
        for p in self.shard.params:
            if p.own_data is not None:
                copy_into(p.own_data, p.base.data.reshape(-1)[p.lo:p.hi])

    def layer_gather(self, comm: Communicator) -> LayerGather | None:
        """Stage 3: the executor's hook that gathers a step's parameters (see
        :class:`LayerGather`), over ``comm`` (a duplicate of the gradients' communicator)."""
        return LayerGather(self, comm) if self.stage >= 3 else None

    def clip_grad_norm(self, max_norm: float) -> float:
        """:func:`~minidl.net.optim.clip_grad_norm_` over every rank's gradients: under stage 2
        each rank sums the squares of its shards and the sums are all-reduced; the shards are
        then scaled alike. Returns the global norm before clipping."""
        if self.stage < 2:
            return clip_grad_norm_(self.inner.params, max_norm)
        grads = [p.grad for p in self.shard.params]
        total = np.zeros(1, dtype=np.float64)
        for g in grads:
            total[0] += float(np.dot(g, g))
        self.comm.allreduce(total)
        return scale_to_norm(grads, math.sqrt(float(total[0])), max_norm)

    def unscale_shards(self, scaler: Any) -> bool:
        """fp16-mixed under stage 2 / 3: ``scaler.unscale`` over this rank's gradient shards;
        whether every rank's are finite (a count of ranks with inf / NaN, all-reduced), so
        all ranks skip the same steps."""
        bad = np.array([0.0 if scaler.unscale(self.shard.params) else 1.0])
        self.comm.allreduce(bad)
        return bool(bad[0] == 0.0)

    def step(self) -> None:
        """Update the owned ranges, then all-gather every rank's updated range."""
        self.shard.lr = self.inner.lr
        self.shard.step()
        self.inner.step_count = self.shard.step_count
        off = 0
        for p in self.shard.params:
            n = p.hi - p.lo
            self._send[off:off + n] = p.data
            off += n
        self.comm.allgather(self._send, self._recv)
        base = 0
        for p, n in zip(self.inner.params, self.sizes):
            np.copyto(p.data.reshape(-1), self._recv[base:base + n])
            base += n

    def state_dict(self) -> dict[str, Any]:
        """The unsharded state in ``inner``'s format, gathered from every rank."""
        mine = self.shard.state_dict()
        parts = self.comm.allgather_object({
            "pieces": [(p.base.name, p.lo, p.hi) for p in self.shard.params], "state": mine})
        out: dict[str, Any] = {"step": mine["step"], "lr": self.inner.lr}
        for p in self.inner.params:
            out[f"{p.name}.step"] = 0
            for slot in self.shard.slots:
                out[f"{p.name}.{slot}"] = np.zeros(p.shape, dtype=p.dtype)
        for part in parts:
            for name, lo, hi in part["pieces"]:
                piece = f"{name}[{lo}:{hi}]"
                out[f"{name}.step"] = part["state"][f"{piece}.step"]
                for slot in self.shard.slots:
                    out[f"{name}.{slot}"].reshape(-1)[lo:hi] = part["state"][f"{piece}.{slot}"]
        return out

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Take this rank's ranges of an unsharded :meth:`state_dict`."""
        mine: dict[str, Any] = {"step": d["step"], "lr": d["lr"]}
        for p in self.shard.params:
            mine[f"{p.name}.step"] = d[f"{p.base.name}.step"]
            for slot in self.shard.slots:
                mine[f"{p.name}.{slot}"] = np.asarray(
                    d[f"{p.base.name}.{slot}"]).reshape(-1)[p.lo:p.hi]
        self.shard.load_state_dict(mine)
        self.inner.lr = float(d["lr"])
        self.params_changed()  # (stage 3: the network's parameters were just loaded)

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({self.inner!r}, stage {self.stage}, rank {self.comm.rank} of "
                f"{self.comm.size}: "
                f"{sum(p.hi - p.lo for p in self.shard.params):,} elements)")


class ZeroShardLayout:
    """ZeRO stages 2 and 3 as the engine allocates them: the gradient shards (stage 2) and the
    parameter shards (stage 3, training) persistent in the pool through the optimizer
    (the shards' ``own_grad`` and ``own_data``) instead of every
    parameter's full gradient (then a block of the iteration) and the trainable parameters
    (which keep their host arrays and are gathered per step into blocks of the iteration). A
    dry run's plain optimizer supplies none (:mod:`minidl.compile.shard_layout`)."""

    def __init__(self, optimizer: ZeroOptimizer, training: bool) -> None:
        stage = self.stage = optimizer.stage
        self.optimizer = optimizer
        self.gradient_specs: list[tuple[str, tuple[int, ...], str]] | None = []
        self.parameter_specs: list[tuple[str, tuple[int, ...], str]] | None = \
            [] if stage >= 3 and training else None

    def keeps_whole(self, param: Any) -> bool:
        """Whether the engine allocates ``param``'s whole block (not under stage 3)."""
        return self.parameter_specs is None or not param.trainable

    def allocate_shards(self, alloc: Any, compute: bool) -> None:
        """The parameter shards (their values copied from the parameters) and gradient shards
        (zeroed) through the engine's ``alloc(name, shape, dtype, category)``."""
        param_specs, grad_specs = self.parameter_specs, self.gradient_specs
        if param_specs is not None:

            def alloc_param(name: str, shape: tuple[int, ...], dtype: Any, values: Any) -> Any:
                arr = alloc(name, shape, dtype, "parameter")
                if compute:
                    copy_into(arr, values)
                param_specs.append((name, tuple(shape), np.dtype(dtype).name))
                return arr

            for p in self.optimizer.shard.params:  # (their values copied in)
                p.own_data = alloc_param(p.name, (p.hi - p.lo,), p.base.dtype,
                                         p.base.data.reshape(-1)[p.lo:p.hi])

        def alloc_grad(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            arr = alloc(name, shape, dtype, "gradient")
            if compute:
                arr[...] = 0
            grad_specs.append((name, tuple(shape), np.dtype(dtype).name))
            return arr

        # (one block per owned range, as memory.passes.zero.zero_bytes counts them)
        for p, (name, shape, dtype) in zip(self.optimizer.shard.params,
                                           self.optimizer.grad_spec()):
            p.own_grad = alloc_grad(name, shape, dtype)



def sharded_optimizer(optimizer: Any, comm: Communicator, stage: int) -> Any:
    """The optimizer a trainer under ``zero=stage`` runs: ``optimizer`` itself for stage 0, a
    :class:`ZeroOptimizer` for stages 1 to 3."""
    if stage == 0:
        return optimizer
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"zero={stage} shards a minidl optimizer, got "
                         f"{type(optimizer).__name__}")
    return ZeroOptimizer(optimizer, comm, stage)


class LayerGather:
    """ZeRO stage 3's gathers: before a step that first uses a parameter's block of the
    iteration (the lowering gives every step its own, see :func:`minidl.compile.lowering.lower`),
    the
    executor calls this hook, which fills the block from every rank's shard of the parameter
    (``Communicator.allgather_v``, each rank sending its owned range, possibly empty)."""

    def __init__(self, opt: ZeroOptimizer, comm: Communicator) -> None:
        self.comm = comm
        params = opt.inner.params
        self._index = {id(p): i for i, p in enumerate(params)}
        dtype = params[0].dtype if params else np.dtype(np.float32)
        empty = np.empty(0, dtype=dtype)
        self._send = [empty] * len(params)
        self._shards: dict[int, ShardParameter] = {}
        for p in opt.shard.params:
            self._shards[self._index[id(p.base)]] = p
        self._counts = [[0] * comm.size for _ in params]
        for r in range(comm.size):
            for i, lo, hi in owned_ranges(opt.sizes, comm.size, r):
                self._counts[i][r] = hi - lo
        self._first: dict[int, tuple[Any, dict[int, list[tuple[int, int]]]]] = {}
        #: Bytes gathered in the last iteration, and how many gathers.
        self.gathered_bytes = 0
        self.gathers = 0

    def _first_uses(self, executor: Any) -> dict[int, list[tuple[int, int]]]:
        """Step index -> (parameter index, tensor) of the gathered blocks that step first
        uses."""
        prog = executor.plan.program
        hit = self._first.get(id(prog))
        if hit is not None and hit[0] is prog:
            return hit[1]
        seen: set[int] = set()
        first: dict[int, list[tuple[int, int]]] = {}
        for i, st in enumerate(executor.steps):
            for t in st.forward.params.values():
                p = executor.parameters.get(t)
                if t in seen or prog.tensors[t].persistent or p is None \
                        or id(p) not in self._index:
                    continue
                seen.add(t)
                first.setdefault(i, []).append((self._index[id(p)], t))
        self._first[id(prog)] = (prog, first)
        return first

    def __call__(self, executor: Any, index: int) -> None:
        if index == 0:
            self.gathered_bytes = self.gathers = 0
        for i, t in self._first_uses(executor).get(index, ()):
            out = executor.last_runtime.array(t)
            shard = self._shards.get(i)
            self.comm.allgather_v(self._send[i] if shard is None else shard.data,
                                  out.reshape(-1), self._counts[i])
            self.gathered_bytes += out.nbytes
            self.gathers += 1
