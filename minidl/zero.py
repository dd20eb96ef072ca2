"""ZeRO stage 1 in training (``zero=1``): each data-parallel rank keeps and updates only its
range of the optimizer state, then the ranks all-gather the parameters.

The ranges are :func:`minidl.memory.zero.owned_ranges` of the trainable parameters flattened
in order (the planner's accounting uses the same function). :class:`ZeroOptimizer` wraps the
user's optimizer: an optimizer of the same class and hyperparameters runs over
:class:`ShardParameter` slices (1-D views of the owned elements of ``.data`` and ``.grad``),
so its state, allocated by the engine through ``init_state``, is this rank's share only. The
gradients are still all-reduced whole (stage 2, reduce-scattered gradients, is planned by
``minidl plan --ranks N`` but not run). The all-gather goes through host buffers of the
parameters' size outside the device pool, as the gradient buckets do.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .comm import Communicator
from .memory.zero import owned_ranges
from .optim import Optimizer, OptimizerWrapper
from .parameter import Parameter


class ShardParameter(Parameter):
    """Elements ``[lo, hi)`` of ``base``'s flattened ``data`` and ``grad``, as a 1-D parameter
    (views, taken anew at each access: ``base`` may be rebound to the device pool)."""

    __slots__ = ("base", "lo", "hi")

    def __init__(self, base: Parameter, lo: int, hi: int) -> None:
        self.base, self.lo, self.hi = base, lo, hi
        super().__init__(f"{base.name}[{lo}:{hi}]", None)

    @property
    def data(self) -> Any:
        return self.base.data.reshape(-1)[self.lo:self.hi]

    @data.setter
    def data(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a shard's data is a view of its parameter's")

    @property
    def grad(self) -> Any:
        g = self.base.grad
        return None if g is None else g.reshape(-1)[self.lo:self.hi]

    @grad.setter
    def grad(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("a shard's gradient is a view of its parameter's")


class ZeroOptimizer(OptimizerWrapper):
    """``inner`` (the user's optimizer, whose ``lr`` a scheduler may set) with its state and
    updates sharded over the ranks of ``comm``; see the module docstring."""

    def __init__(self, inner: Optimizer, comm: Communicator) -> None:
        self.inner = inner
        self.comm = comm
        params = inner.params
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"zero=1 shards one flat range of the parameters: they must share "
                             f"a dtype, got {sorted(map(str, dtypes))}")
        self.sizes = [int(np.prod(p.shape)) for p in params]
        owned = owned_ranges(self.sizes, comm.size, comm.rank)
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

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({self.inner!r}, rank {self.comm.rank} of {self.comm.size}: "
                f"{sum(p.hi - p.lo for p in self.shard.params):,} elements)")


def sharded_optimizer(optimizer: Any, comm: Communicator, stage: int) -> Any:
    """The optimizer a trainer under ``zero=stage`` runs: ``optimizer`` itself for stage 0, a
    :class:`ZeroOptimizer` for stage 1; stages 2 and 3 are refused (planned, not run)."""
    if stage == 0:
        return optimizer
    if stage >= 2:
        raise ValueError(f"zero={stage} is planned (minidl plan --ranks N) but not trained yet: "
                         "train with zero=1 (optimizer state sharded)")
    if not isinstance(optimizer, Optimizer):
        raise ValueError(f"zero=1 shards a minidl optimizer, got {type(optimizer).__name__}")
    return ZeroOptimizer(optimizer, comm)
