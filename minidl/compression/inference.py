"""Inference straight from a compressed model: each layer's weights are decoded into the
device pool just before the layer runs and freed after it.

The network is lowered for inference as usual; then :func:`inference_program` rewrites the
program: every parameter tensor stops being persistent state and becomes a block of the
iteration written by a ``decode`` step (codec ``"weights"``, :mod:`minidl.memory.passes.codecs`)
placed right before the first step that reads it, from its compressed record, which is fed
with the batch (as a small device reads its model from flash) and freed once decoded. The
ordinary planner (``reuse,inplace``) frees each decoded weight after its last use, so at most
the weights of the layer running (plus the records not decoded yet) are on the device.

Nothing else changes: the executor runs the plan (it reads a parameter the program
materialises from the iteration's blocks), and the same program on the meta device gives the
exact peak of a real run (:func:`plan_inference`, ``minidl plan --inference --compressed``).

Devices: ``cpu`` decodes with the Numba CPU kernels; ``cuda`` (and ``cuda-strict``, its code
path on the CPU with CuPy's rules checked) feeds the records to the device like the batch and
decodes them there with the Numba CUDA kernels of :mod:`minidl.kernels.compression.weight_record`,
so no
weight crosses to the host. The program is lowered for the device's kind (the layers'
workspaces differ), and the meta run of :func:`plan_inference` takes the same kind. Records
are checked on the host when the runner is made (the device decoder reports nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..compile.executor import Executor
from ..compile.lowering import Lowered, lower
from ..kernels.compression.weight_record import RecordError, check, info
from ..memory.device_factory import make_device
from ..memory.devices.device import MetaDevice
from ..memory.devices.traits import device_traits
from ..memory.ir.config import MemoryConfig
from ..memory.ir.names import DeviceKind
from ..memory.ir.payloads import CodecStep
from ..memory.ir.plan import Plan
from ..memory.ir.program import Step, TensorSpec
from ..memory.ir.step_parts import OpTraits, StepAccess
from ..memory.ir.units import ALLOCATION_UNIT
from ..memory.planners.planner import make_plan
from ..memory.runtime.host_pool import HostPool
from ..memory.runtime.pool import Pool
from ..net.graph import Network
from ..zoo.models import get_model
from .container import CompressedModel, CompressedModelError

#: The memory spec of inference (no backward: every tensor freed after its last use).
INFERENCE_SPEC = "reuse,inplace"


def build_network(cm: CompressedModel) -> Network:
    """The network the file describes (its weights are still the builder's: the records hold
    the trained ones), checked against the records' names and shapes."""
    m = cm.model
    try:
        net = get_model(m["name"], input_shape=tuple(m["input_shape"]),
                        num_classes=int(m["num_classes"]), width=m.get("width"))
    except (KeyError, TypeError, ValueError) as e:
        raise CompressedModelError(f"the compressed model names a network minidl cannot build "
                                   f"({m}): {e}") from None
    params = dict(net.named_parameters(include_buffers=True))
    if set(params) != set(cm.records):
        raise CompressedModelError(
            f"the records ({', '.join(cm.records)}) are not the parameters of {net.name} "
            f"({', '.join(params)})")
    for name, rec in cm.records.items():
        shape = info(rec).shape
        if tuple(shape) != params[name].shape:
            raise CompressedModelError(f"record {name} has shape {tuple(shape)}, {net.name} "
                                       f"needs {params[name].shape}")
    return net


def check_records(cm: CompressedModel, net: Network) -> None:
    """Check every record of ``cm`` on the host (streams included) against the dtype of its
    parameter of ``net`` (:func:`~minidl.kernels.compression.weight_record.check`)."""
    params = dict(net.named_parameters(include_buffers=True))
    for name, rec in cm.records.items():
        try:
            check(rec, params[name].data.dtype)
        except RecordError as e:
            raise CompressedModelError(f"record {name}: {e}") from None


def inference_program(net: Network, record_sizes: dict[str, int],
                      batch_shape: tuple[int, ...], alignment: int = ALLOCATION_UNIT,
                      device_kind: str = "cpu") -> Lowered:
    """``net`` lowered for inference on ``batch_shape`` for a ``device_kind`` device with
    every parameter decoded from its record (``record_sizes``: parameter name -> record
    bytes) right before its first use."""
    low = lower(net, [tuple(batch_shape)], loss=None, training=False, alignment=alignment,
                device_kind=device_kind)
    prog = low.program
    tensors = list(prog.tensors)
    inputs = list(prog.inputs)
    record_of: dict[int, int] = {}
    for name, tid in low.param_tensors.items():
        t = tensors[tid]
        tensors[tid] = replace(t, persistent=False)
        rid = len(tensors)
        tensors.append(TensorSpec(rid, f"{name}.record", (int(record_sizes[name]),), "uint8",
                                  "encoded", "value", t.layer))
        inputs.append(rid)
        record_of[tid] = rid
    steps: list[Step] = []
    for st in prog.steps:
        for tid in st.forward.params.values():
            rid = record_of.pop(tid, None)
            if rid is None:
                continue  # decoded already (a shared parameter)
            steps.append(Step(index=len(steps), phase="decode", layer=st.layer, kind="decode",
                              node=-1, access=StepAccess((rid,), (tid,)),
                              op=OpTraits(codec=CodecStep("weights", rid))))
        steps.append(replace(st, index=len(steps)))
    program = replace(prog, tensors=tensors, steps=steps, inputs=inputs)
    return replace(low, program=program, parameters={})


@dataclass
class InferenceRun:
    """One batch shape's program and plan."""

    lowered: Lowered
    plan: Plan


class CompressedRunner:
    """Runs a compressed model on a device pool (``device``: a name of
    :func:`~minidl.memory.device_factory.make_device`: ``"cpu"``, ``"cuda"``, ``"cuda:N"``,
    ``"cuda-strict"``, or ``"meta"``, which plans for a ``device_kind`` device; the others
    set the kind themselves).

    ``device_memory`` (bytes) defaults to what the largest batch needs (its meta run's
    reserved peak, rounded up to a MiB). ``pool.stats()`` holds the peak after running."""

    def __init__(self, cm: CompressedModel, device: str = "cpu",
                 device_memory: int | None = None, alignment: int = ALLOCATION_UNIT,
                 device_kind: str = "cpu") -> None:
        self.cm = cm
        self.net = build_network(cm)
        self.device_name = device
        self.device_memory = device_memory
        self.alignment = alignment
        #: The kind of device the programs are lowered for ("cpu" or "cuda").
        self.device_kind = device_kind if device == "meta" else \
            DeviceKind.CPU if device.strip().lower() == DeviceKind.CPU else DeviceKind.CUDA
        if device != "meta":
            check_records(cm, self.net)
        self.records = [np.frombuffer(r, dtype=np.uint8) for r in cm.records.values()]
        self._runs: dict[tuple[int, ...], InferenceRun] = {}
        self.pool: Pool | None = None
        self.last_runtime: Any = None

    def run_for(self, batch_shape: tuple[int, ...]) -> InferenceRun:
        """The program and plan for inputs of ``batch_shape`` (cached)."""
        key = tuple(batch_shape)
        if key not in self._runs:
            sizes = {n: len(r) for n, r in self.cm.records.items()}
            low = inference_program(self.net, sizes, key, self.alignment, self.device_kind)
            self._runs[key] = InferenceRun(low, make_plan(low.program,
                                                          MemoryConfig.parse(INFERENCE_SPEC)))
        return self._runs[key]

    def _pool_for(self, batch_shape: tuple[int, ...]) -> Pool:
        if self.pool is None:
            if self.device_name == "meta":
                device = MetaDevice(kind=self.device_kind)
            else:
                need = self.device_memory
                if need is None:
                    meta = CompressedRunner(self.cm, "meta", alignment=self.alignment,
                                            device_kind=self.device_kind)
                    meta.run_batch(None, batch_shape)
                    mib = 1 << 20
                    need = -(-meta.pool.stats()["reserved_bytes.peak"] // mib) * mib
                device = make_device(self.device_name, need)
            self.pool = Pool(device, alignment=self.alignment)
        return self.pool

    def run_batch(self, x: np.ndarray | None, batch_shape: tuple[int, ...] | None = None
                  ) -> np.ndarray | None:
        """The network's output for one batch (``x=None`` on the meta device: memory only)."""
        shape = tuple(x.shape) if x is not None else tuple(batch_shape)
        run = self.run_for(shape)
        pool = self._pool_for(shape)
        compute = device_traits(pool.device).has_storage
        ex = Executor(run.lowered, run.plan, pool, compute=compute,
                      host_pool=HostPool(pool.device, None))
        feeds = [x, *self.records] if compute else [None] * (1 + len(self.records))
        _, outs = ex.run(feeds, training=False, fetch_outputs=compute)
        self.last_runtime = ex.last_runtime
        return outs[0] if compute else None

    def predict(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """Outputs for ``x`` in batches (the first batch sizes the pool)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(x) == 0:
            raise ValueError("no inputs to predict")
        self._pool_for((min(batch_size, len(x)), *x.shape[1:]))
        return np.concatenate([self.run_batch(x[i:i + batch_size])
                               for i in range(0, len(x), batch_size)])


def plan_inference(cm: CompressedModel, batch_size: int, alignment: int = ALLOCATION_UNIT,
                   device_kind: str = "cpu") -> dict[str, Any]:
    """The exact device peak of inference from ``cm`` on a batch of ``batch_size`` on a
    ``device_kind`` (``"cpu"`` or ``"cuda"``) device (a meta run of the program
    :class:`CompressedRunner` runs there), with the bytes the uncompressed weights alone
    would take."""
    runner = CompressedRunner(cm, "meta", alignment=alignment, device_kind=device_kind)
    shape = (int(batch_size), *map(int, cm.model["input_shape"]))
    runner.run_batch(None, shape)
    stats = runner.pool.stats()
    rt = runner.last_runtime
    rt.peak.snapshot(rt.records)
    prog = runner.run_for(shape).lowered.program
    by_cat: dict[str, int] = {}
    live = []
    for tid in rt.peak.live:
        t = prog.tensors[tid]
        size = prog.block_size(t.nbytes)
        by_cat[t.category] = by_cat.get(t.category, 0) + size
        live.append({"tensor": t.name, "category": t.category, "bytes": size})
    live.sort(key=lambda r: -r["bytes"])
    pos = rt.peak.position
    step = prog.steps[pos] if 0 <= pos < len(prog.steps) else None
    params = dict(runner.net.named_parameters(include_buffers=True))
    return {
        "model": runner.net.name, "batch_size": int(batch_size), "input": list(shape[1:]),
        "device": "meta" if device_kind == DeviceKind.CPU else f"meta ({device_kind} kind)",
        "memory": f"{INFERENCE_SPEC} (weights decoded per layer from the compressed file)",
        "peak_allocated_bytes": stats["allocated_bytes.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.peak"],
        "compressed_record_bytes": cm.record_bytes(),
        "dense_weight_bytes": sum(p.nbytes for p in params.values()),
        "breakdown": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "peak_step": {"layer": step.layer if step else "(start)",
                      "phase": step.phase if step else "setup", "index": pos},
        "live_at_peak": live[:10],
        "num_steps": len(prog.steps),
    }
