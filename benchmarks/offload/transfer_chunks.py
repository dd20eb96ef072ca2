"""Chunks for the parameters' copy back (PatrickStar / Gemini): how much of ``offload=optimizer``'s
copy back per step is per-transfer overhead when each parameter is its own transfer, against
parameters grouped in order into chunks of at most 4 or 32 MiB (a larger one alone).

    python benchmarks/offload/transfer_chunks.py            # both models, both measures
    python benchmarks/offload/transfer_chunks.py --quick    # GPT-2 small only
    python benchmarks/offload/transfer_chunks.py --trainer  # the implementation, measured

The copied bytes are the device's blocks of the parameters (each rounded to the pool's 512 B
unit; in bf16-mixed the matrix ops' weights come back as their half copies,
minidl/compile/host_state.py), per model from its real parameter list (built with deferred
values: nothing is allocated).

* ``model``: the cost model's link (memory/cost): a transfer takes ``bytes / link_h2d`` and
  nothing per transfer, so chunking changes nothing; beside it the same with a per-transfer
  latency of the profile's ``launch_s`` (5 us, the model's only fixed per-operation cost)
  standing in for a cudaMemcpyAsync's.
* ``emulated``: the copies run through this machine's throttled copy engine
  (memory/devices/copy_engine.py) at the target's link / ``--slowdown`` x (target FP32 FLOP/s
  / V100's), the emulated link of memory/cost/link_emulation.py, from one host buffer into one
  "device" buffer, every copy queued then synchronised (HostState.upload's pattern); the
  measured seconds against ``bytes / rate``. GPT-2 XL's blocks repeat: its first ``--blocks``
  transformer blocks are measured (the embeddings are one transfer each either way).
* ``--trainer``: the implementation (minidl/compile/chunked_upload.py) in real
  ``offload=optimizer`` steps with ``Trainer(emulate_link=P)``: the copy back's seconds
  (``swap_stats["parameter_upload_s"]``, median of ``--steps`` after ``--warmup``) in 32 MiB
  chunks and one parameter at a time (``host_state.chunks = None``), and the median of its
  ratio to its bytes over the emulated link's rate in force at that copy, for a GPT of GPT-2
  small's 148 tensors at width 256 (12 blocks, vocabulary 50257, context 8, batch 2).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

import minidl
from minidl.compile.host_state import half_parameters
from minidl.memory.cost.targets import get_target
from minidl.memory.devices.copy_engine import CopyEngine
from minidl.memory.ir.precision import Precision
from minidl.memory.ir.program import aligned
from minidl.memory.ir.units import ALLOCATION_UNIT
from minidl.net.deferred_init import deferred_parameters
from minidl.net.optim import AdamW
from minidl.zoo.transformers import CONFIGS, TransformerConfig, gpt

MODELS = {"gpt2-small": CONFIGS["gpt2-small"],
          "gpt2-xl": TransformerConfig(48, 25, 1600, 1024, 50257, dropout=0.1, gelu="tanh")}
TARGETS = ("v100", "a100", "h100")
CHUNKS = (4 << 20, 32 << 20)
MIB = 1 << 20


def transfer_sizes(config: TransformerConfig, precision: Precision,
                   blocks: int | None = None) -> list[int]:
    """The device bytes of each trainable parameter in order (``blocks``: only the embeddings,
    the first ``blocks`` transformer blocks and the final norm)."""
    with deferred_parameters():
        net = gpt(config)
    half = half_parameters(net, precision)
    out = []
    for name, p in net.named_parameters():
        block = name.split(".h.")[1].split(".")[0] if ".h." in name else None
        if blocks is not None and block is not None and int(block) >= blocks:
            continue
        item = 2 if name in half else np.dtype(p.dtype).itemsize
        out.append(aligned(math.prod(p.shape) * item, ALLOCATION_UNIT))
    return out


def chunked(sizes: list[int], chunk: int | None) -> list[int]:
    """``sizes`` grouped in order into transfers of at most ``chunk`` bytes (a larger tensor
    alone); ``None``: one transfer per tensor."""
    if chunk is None:
        return list(sizes)
    out, cur = [], 0
    for s in sizes:
        if cur and cur + s > chunk:
            out.append(cur)
            cur = 0
        cur += s
        if cur >= chunk:
            out.append(cur)
            cur = 0
    return out + ([cur] if cur else [])


def model_row(sizes: list[int], target: str) -> dict:
    """The copy back's seconds on ``target`` per grouping: the model's (no per-transfer cost)
    and with ``launch_s`` per transfer."""
    p = get_target(target)
    total = sum(sizes)
    row = {"bytes": total, "model_s": total / p.link_h2d_bytes_per_s}
    for chunk in (None, *CHUNKS):
        n = len(chunked(sizes, chunk))
        row[chunk] = {"transfers": n, "latency_s": n * p.launch_s + row["model_s"]}
    return row


def emulated_s(sizes: list[int], rate: float, repeats: int = 2) -> float:
    """Best of ``repeats`` seconds to copy ``sizes`` through a copy engine throttled to
    ``rate`` (every copy queued, then synchronised)."""
    total = sum(sizes)
    src = np.ones(total, np.uint8)
    dst = np.empty(total, np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    engine = CopyEngine("chunks", bytes_per_s=rate)
    best = math.inf
    try:
        engine.copy_async(dst[:1], src[:1])  # (the worker thread started)
        engine.synchronize()
        for _ in range(repeats):
            time.sleep(0.05)  # (the link idle: the slot chain starts at the first copy)
            t0 = time.perf_counter()
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                engine.copy_async(dst[a:b], src[a:b])
            engine.synchronize()
            best = min(best, time.perf_counter() - t0)
    finally:
        engine.close()
    return best


def trainer_upload(target: str, chunked: bool, warmup: int, steps: int) -> tuple[float, float]:
    """Medians over real offload steps on ``target``'s emulated link of the copy back's
    seconds and of its ratio to its bytes over the link's rate in force at that copy (the
    throttle follows the measured slowdown from step to step)."""
    config = TransformerConfig(12, 4, 256, 8, 50257)
    net = gpt(config)
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-4), device_memory="512MiB",
                        memory="reuse,inplace,offload=optimizer", emulate_link=target)
    if not chunked:
        tr.engine.host_state.chunks = None
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, config.vocab, (2, config.context)) for _ in range(2))
    times, ratios = [], []
    for k in range(warmup + steps):
        tr.step(x, y)
        if k >= warmup:
            t = tr.swap_stats["parameter_upload_s"]
            times.append(t)
            ratios.append(t * tr.device.copy_engine.bytes_per_s / tr.engine.host_state.upload_bytes)
    tr.close()
    return float(np.median(times)), float(np.median(ratios))


def trainer_rows(warmup: int, steps: int) -> None:
    print("| target | chunks | copy back: measured s | over bytes / emulated rate |")
    print("|---|---|---|---|")
    for target in TARGETS:
        for chunked in (False, True):
            t, ratio = trainer_upload(target, chunked, warmup, steps)
            print(f"| {target} | {'32 MiB' if chunked else 'each'} | {t:.3f} | "
                  f"{100 * (ratio - 1):+.1f} % |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 small only")
    ap.add_argument("--slowdown", type=float, default=50.0,
                    help="this CPU's slowdown against a V100 (others scaled by FP32 FLOP/s)")
    ap.add_argument("--blocks", type=int, default=4, help="GPT-2 XL blocks measured emulated")
    ap.add_argument("--trainer", action="store_true", help="the implementation in real steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    if args.trainer:
        trainer_rows(args.warmup, args.steps)
        return
    v100 = get_target("v100")
    print("| model | precision | target | bytes | transfers: each / 4 MiB / 32 MiB | model: ms, "
          "per-transfer share | latency 5 us: each ms (share) / 4 MiB / 32 MiB, chunks save |")
    print("|---|---|---|---|---|---|---|")
    emu_rows = []
    for name in (["gpt2-small"] if args.quick else list(MODELS)):
        for precision in (Precision.FP32, Precision.BF16_MIXED):
            sizes = transfer_sizes(MODELS[name], precision)
            for target in TARGETS:
                r = model_row(sizes, target)
                each, c4, c32 = r[None], r[CHUNKS[0]], r[CHUNKS[1]]
                share = 1 - r["model_s"] / each["latency_s"]
                save = 1 - min(c4["latency_s"], c32["latency_s"]) / each["latency_s"]
                print(f"| {name} | {precision} | {target} | {r['bytes'] / MIB:.1f} MiB | "
                      f"{each['transfers']} / {c4['transfers']} / {c32['transfers']} | "
                      f"{1e3 * r['model_s']:.2f}, 0 % | {1e3 * each['latency_s']:.2f} "
                      f"({100 * share:.1f} %) / {1e3 * c4['latency_s']:.2f} / "
                      f"{1e3 * c32['latency_s']:.2f}, {100 * save:.1f} % |")
            blocks = args.blocks if name == "gpt2-xl" else None
            emu_rows.append((name, precision, blocks, transfer_sizes(MODELS[name], precision,
                                                                     blocks)))
    print()
    print("| model | precision | target | emulated link MB/s | bytes | bytes / rate s | "
          "each: s (over) | 4 MiB: s (over) | 32 MiB: s (over) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, precision, blocks, sizes in emu_rows:
        for target in TARGETS:
            p = get_target(target)
            rate = p.link_h2d_bytes_per_s / (args.slowdown * p.flops_per_s / v100.flops_per_s)
            ideal = sum(sizes) / rate
            cells = []
            for chunk in (None, *CHUNKS):
                t = emulated_s(chunked(sizes, chunk), rate)
                cells.append(f"{t:.3f} ({100 * (t / ideal - 1):+.1f} %)")
            label = name if blocks is None else f"{name} ({blocks} blocks)"
            print(f"| {label} | {precision} | {target} | {rate / 1e6:.0f} | "
                  f"{sum(sizes) / MIB:.1f} MiB | {ideal:.3f} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
