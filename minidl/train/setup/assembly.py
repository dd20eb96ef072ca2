"""A :class:`~minidl.train.trainer.Trainer`'s parts, assembled from its options: the device and
its pool, the optimizer (sharded under ZeRO), the engine and data parallelism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...compile.engine import Engine
from ...compile.host_state import OffloadedOptimizer
from ...distributed.comm import SingleProcess
from ...distributed.data_parallel import DataParallel
from ...distributed.offload_sync import OffloadSync
from ...distributed.zero import sharded_optimizer
from ...distributed.zero_offload import ZeroOffloadOptimizer
from ...memory.cost.link_emulation import LinkEmulation
from ...memory.devices.traits import DeviceTraits, device_traits
from ...memory.ir.config import MemoryConfig
from ...memory.ir.units import parse_size
from ...memory.runtime.pool import Pool
from ...net.graph import Network
from ...net.optim import SGD
from .device_setup import set_up_device
from .trainer_options import TrainerOptions


@dataclass
class Assembly:
    """The parts a trainer trains with (``parallel`` is ``None`` on one process below
    ``zero=2``; ``link_emulation`` without ``emulate_link``)."""

    device: Any
    pool: Pool
    traits: DeviceTraits
    link_emulation: LinkEmulation | None
    optimizer: Any
    engine: Engine
    parallel: DataParallel | None


def default_optimizer(net: Network) -> SGD:
    """SGD with momentum 0.9 at learning rate 0.01."""
    return SGD(net.parameters(), lr=0.01, momentum=0.9)


def assemble(net: Network, optimizer: Any, config: MemoryConfig, loss: Any,
             options: TrainerOptions) -> Assembly:
    """The device, pool, optimizer (this rank's share under ``zero``), engine and data
    parallelism for training ``net`` with ``loss`` under ``config``."""
    dev = options.device
    setup = set_up_device(dev.device, dev.device_memory, dev.host_memory, dev.debug,
                          dev.threads, dev.alignment, dev.emulate_link)
    par = options.parallel
    comm = par.comm or SingleProcess()
    optimizer = sharded_optimizer(optimizer if optimizer is not None else default_optimizer(net),
                                  comm, config.zero)  # zero=1: this rank's share
    engine = Engine(net, setup.pool, config, loss, optimizer,
                    host_memory=None if dev.host_memory is None else parse_size(dev.host_memory),
                    target=setup.target, precision=options.step.precision)
    sync = None
    if engine.host_state is not None:  # offload=optimizer: the update on the host
        optimizer = ZeroOffloadOptimizer(optimizer, engine.host_state) if config.zero \
            else OffloadedOptimizer(optimizer, engine.host_state)  # (zero: the owned ranges)
        if comm.size > 1 and config.zero < 2:  # the gradients summed where they land (zero=2:
            # reduce-scattered from the buckets into the host's shards, as on the device)
            sync = OffloadSync(comm, net.parameters(), engine.host_state, par.bucket_bytes)
    # (zero=2 moves the gradients into the optimizer's shards through the buckets, even on
    # one rank)
    parallel = None if comm.size == 1 and config.zero < 2 else DataParallel(
        comm, net, config.spec, optimizer, options.step.seed, par.bucket_bytes,
        sync_bn=par.sync_bn, sync=sync)
    return Assembly(setup.device, setup.pool, device_traits(setup.device),
                    setup.link_emulation, optimizer, engine, parallel)
