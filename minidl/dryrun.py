"""The meta dry run: the exact peak of a training iteration, without data or compute."""

from __future__ import annotations

from typing import Any

from .engine import Engine
from .graph import Network
from .layers.base import Layer
from .memory.config import MemoryConfig
from .memory.device import MetaDevice
from .memory.pool import Pool


def make_optimizer(name: str, params: list, lr: float | None = None,
                   weight_decay: float = 0.0) -> Any:
    """An optimizer by CLI name: ``sgd`` (momentum 0.9, default lr 0.05), ``adam`` and
    ``adamw`` (default lr 1e-3)."""
    from . import optim

    name = name.lower()
    if name == "sgd":
        return optim.SGD(params, lr=0.05 if lr is None else lr, momentum=0.9,
                         weight_decay=weight_decay)
    if name == "adam":
        return optim.Adam(params, lr=1e-3 if lr is None else lr, weight_decay=weight_decay)
    if name == "adamw":
        return optim.AdamW(params, lr=1e-3 if lr is None else lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adam, adamw")


def dry_run(
    net: Network,
    batch_size: int,
    memory: str | MemoryConfig = "none",
    optimizer: str = "sgd",
    loss: Layer | None = None,
    label_shape: tuple[int, ...] | None = None,
    input_shape: tuple[int, ...] | None = None,
    top: int = 10,
    training: bool = True,
) -> dict[str, Any]:
    """Run one training iteration of ``net`` on the meta device and report its memory.

    The pool places every block exactly as a real run would, so ``peak_allocated_bytes``
    equals a real run's. Keys: ``peak_allocated_bytes``, ``peak_reserved_bytes``,
    ``lower_bound_bytes``, ``persistent_bytes``, ``breakdown`` (bytes by category at the peak),
    ``peak_step`` (layer, phase, index), ``live_at_peak`` (the largest tensors live there).
    """
    from .layers import SoftmaxCrossEntropy

    config = MemoryConfig.parse(memory)
    shape = tuple(input_shape) if input_shape is not None else net.input_shapes[0]
    if shape is None:
        raise ValueError("the network has no input shape: pass input_shape")
    pool = Pool(MetaDevice())
    loss = loss if loss is not None else SoftmaxCrossEntropy()
    opt = make_optimizer(optimizer, net.parameters()) if training else None
    engine = Engine(net, pool, config, loss if training else None, opt, bind=False)
    batch = (int(batch_size), *shape)
    c = engine.compiled([batch], label_shape or (int(batch_size),), training=training)
    c.executor.run([None, None], training=training)
    info = engine.peak_info(c)
    swap = c.executor.last_runtime.swap_stats.as_dict()
    swap["host_peak_bytes"] = engine.host_pool.peak_bytes
    stats = pool.stats()
    prog = c.lowered.program
    return {
        "model": net.name,
        "memory": config.spec,
        "batch_size": int(batch_size),
        "input": list(shape),
        "peak_allocated_bytes": stats["allocated_bytes.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.peak"],
        "lower_bound_bytes": prog.lower_bound_bytes(),
        "persistent_bytes": prog.persistent_bytes(),
        "breakdown": dict(sorted(info.by_category.items(), key=lambda kv: -kv[1])),
        "peak_step": {"layer": info.step, "phase": info.phase, "index": info.position},
        "live_at_peak": [{"tensor": n, "category": c_, "bytes": b} for n, c_, b in info.live[:top]],
        "num_steps": len(prog.steps),
        "num_tensors": len(prog.tensors),
        "host_peak_bytes": engine.host_pool.peak_bytes,
        "swap": swap if c.plan.swapped else {},
        "notes": list(c.plan.notes),
    }
