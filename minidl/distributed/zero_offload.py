"""ZeRO-Offload under ZeRO stages 1 and 2 (Ren et al., "ZeRO-Offload", 2021): each rank's host
keeps the float32 master weights and the optimizer state of the rank's owned ranges only
(:class:`~minidl.compile.host_state.HostState` with ``owned``), and runs the update over them.

* ``zero=1``: the gradients land whole on the host as backward writes them (the plan's copies,
  as on one rank) and :class:`~.offload_sync.OffloadSync` all-reduces them there; the update
  reads the owned ranges of them.
* ``zero=2``: the host keeps only the owned ranges' gradients too. As ZeRO stage 2 does on the
  device, :class:`~.data_parallel.GradientSync` takes each gradient into its bucket at its last
  write and reduce-scatters the buckets (half an all-reduce's bytes), each rank receiving its
  owned range's sums straight into its host's gradient shards; the plan copies nothing.

:class:`ZeroOffloadOptimizer` steps the shards on the host (:class:`~.zero.ZeroOptimizer`),
all-gathers every rank's updated range into the parameters (the device's copies; those the
device keeps only as half copies: their host arrays) and rounds the half copies. The device
keeps every parameter, as under ZeRO stages 1 and 2.
"""

from __future__ import annotations

from typing import Any

from ..net.optim import OptimizerWrapper
from .zero import ZeroOptimizer


class ZeroOffloadOptimizer(OptimizerWrapper):
    """``inner`` (a :class:`~.zero.ZeroOptimizer`, stage 1 or 2) stepping its shards over
    ``host_state``'s owned ranges (see the module docstring)."""

    def __init__(self, inner: ZeroOptimizer, host_state: Any) -> None:
        if inner.stage not in (1, 2):
            raise ValueError(f"offload shards the host's state under zero=1 or zero=2, got "
                             f"zero={inner.stage}")
        if host_state.owned != inner.owned:
            raise ValueError("offload under ZeRO: the host keeps other ranges than the "
                             "optimizer's shards")
        super().__init__(inner)
        self.host_state = host_state

    @property
    def stage(self) -> int:
        return self.inner.stage

    @property
    def shard(self) -> Any:
        """The optimizer over this rank's ranges (:class:`~.zero.ShardParameter` s)."""
        return self.inner.shard

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank holds only its ranges' summed gradients (``zero=2``)."""
        return self.inner.shards_gradients

    def clip_grad_norm(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm(max_norm)

    def unscale_shards(self, scaler: Any) -> bool:
        return self.inner.unscale_shards(scaler)

    def step(self) -> None:
        """Update the owned ranges on the host, all-gather them into the parameters, round
        the device's half copies."""
        self.inner.step()
        self.host_state.upload()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)
        self.host_state.download()

    def params_changed(self) -> None:
        """The parameters were set (broadcast from rank 0): the owned master weights from
        them."""
        self.host_state.download()

    def __repr__(self) -> str:
        return f"ZeroOffloadOptimizer({self.inner!r})"
