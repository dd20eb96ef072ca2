"""``offload=optimizer``'s step predicted against measured on the CPU with an emulated link.

    python benchmarks/offload/link_emulation_offload.py            # every case
    python benchmarks/offload/link_emulation_offload.py --quick    # the first GPT on v100

As benchmarks/measured/link_emulation.py does for swapping: each case trains a GPT with
``Trainer(emulate_link=P)`` (copies throttled to ``P``'s link / the CPU's measured slowdown,
memory/cost/link_emulation.py), under ``reuse,inplace`` (state on the device, a 256 MiB arena)
and ``reuse,inplace,offload=optimizer`` (the arena a third of the float32 state where the plan
fits in it). After ``--warmup`` steps, ``--steps`` are timed (medians). The step's parts:

* ``device`` — forward and backward with the gradients' copies to the host (measured: the
  step less the two parts below), against the cost model's iteration on ``P`` x slowdown
  (``pred``) and against the model with the step's measured step times and the emulated link
  in force (``cpu-t``: the copy/overlap model alone); ``stall`` — compute waiting for a
  copy (the runtime's ``swap_stats.stall_s``, also in the Trainer's ``swap_stats``) against
  the model's;
* ``update`` — the host update (the fused kernel over the host's float32 state, timed around
  the inner optimizer's ``step``), against memory/cost/host_update.py's price: the host is
  this CPU, so not scaled by the slowdown;
* ``back`` — the parameters' copy back (through the throttled copy engine), against the
  model's bytes / ``P``'s link x slowdown (``pred``) and / the emulated link in force at
  the copy (``cpu-t``).

The slowdown in ``pred`` is the step's own; the throttle follows the median of the last
iterations' (link_emulation.WINDOW), so on a loaded machine ``pred`` carries the difference
and ``cpu-t`` does not.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time

import numpy as np

import minidl
from minidl.memory.cost.cost_model import simulate
from minidl.memory.cost.host_update import HOST_UPDATE_BYTES_PER_S, host_update
from minidl.memory.cost.link_emulation import compute_slowdown
from minidl.memory.cost.targets import get_target
from minidl.net.optim import AdamW
from minidl.zoo.transformers import TransformerConfig, gpt

#: (name, config, batch): the first is tests/minidl/compile/test_offload_gpt_3x.py's GPT.
MODELS = [
    ("gpt8x256-c8b2", TransformerConfig(8, 4, 256, 8, 64, dropout=0.1), 2),
    ("gpt8x256-c64b4", TransformerConfig(8, 4, 256, 64, 64, dropout=0.1), 4),
]
SPECS = ["reuse,inplace", "reuse,inplace,offload=optimizer",
         "reuse,inplace,offload=parameters"]
#: A V100 behind a slow host link (PCIe 3.0 x4-like), as in the swapping comparison.
SLOW_LINK = "custom:flops=15.7T,hbm=900G,link=4G,mem=16GiB"
TARGETS = ["v100", "titanx-maxwell", SLOW_LINK]


def _timed(fn, into: dict, key: str):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            into[key] = time.perf_counter() - t0
    return wrapper


def device_memory(config: TransformerConfig, batch: int, spec: str) -> int | str:
    """A third of the float32 state under offload=optimizer, a sixth (below the parameters
    alone) under offload=parameters, where the plan fits there; else 256 MiB."""
    if "offload" not in spec:
        return "256MiB"
    state = minidl.dry_run(gpt(config), batch, "reuse,inplace", "adamw")["persistent_bytes"]
    arena = state // (6 if "parameters" in spec else 3)
    need = minidl.dry_run(gpt(config), batch, spec, "adamw")["peak_reserved_bytes"]
    return arena if need <= arena else "256MiB"


def run_case(config, batch, spec, target, warmup, steps):
    """Medians over the timed steps of the measured and predicted parts (seconds)."""
    profile = get_target(target)
    net = gpt(config)
    mem = device_memory(config, batch, spec)
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-3), memory=spec,
                        device_memory=mem, emulate_link=profile)
    parts = {"update": 0.0, "back": 0.0}
    state = tr.engine.host_state
    if state is not None:
        tr.optimizer.inner.step = _timed(tr.optimizer.inner.step, parts, "update")
        state.upload = _timed(state.upload, parts, "back")
    else:
        tr.optimizer.step = _timed(tr.optimizer.step, parts, "update")
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab, (batch, config.context))
    y = rng.integers(0, config.vocab, (batch, config.context))
    for _ in range(warmup):
        tr.step(x, y)
    rows = []
    for _ in range(steps):
        before = tr.device.link_bytes_per_s  # the gradients' copies run at this rate
        t0 = time.perf_counter()
        tr.step(x, y)
        dt = time.perf_counter() - t0
        after = tr.device.link_bytes_per_s  # (re-set from this step's times: the copy back's)
        c = tr.last_compiled
        times = list(c.executor.step_times)
        slow = compute_slowdown(c.plan.program, times, profile)
        pred = simulate(c.plan, profile)
        cpu = simulate(c.plan, dataclasses.replace(profile, link_h2d_bytes_per_s=before,
                                                   link_d2h_bytes_per_s=before),
                       step_times=times)
        row = {"arena": tr.device.capacity, "slowdown": slow, "step": dt,
               "device": dt - parts["update"] - parts["back"],
               "device_pred": pred.step_s * slow, "device_cpu": cpu.step_s,
               "stall": c.executor.last_runtime.swap_stats.stall_s,
               "stall_pred": pred.stall_s * slow, "stall_cpu": cpu.stall_s,
               "update": parts["update"], "update_pred": 0.0, "back": parts["back"],
               "back_pred": 0.0, "back_cpu": 0.0, "moved": 0}
        if state is not None:
            values = sum(math.prod(p.shape) for p in state.params)
            hu = host_update(values, len(state.slots), state.upload_bytes, profile)
            row.update(update_pred=hu.update_s, back_pred=hu.upload_s * slow,
                       back_cpu=state.upload_bytes / after, moved=hu.state_moved_bytes)
        row["step_pred"] = row["device_pred"] + row["update_pred"] + row["back_pred"]
        rows.append(row)
    tr.close()
    tr.device.close()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def ratio(a: float, b: float) -> str:
    if b <= 0:
        return "  -  " if a <= 0 else "  inf"
    return f"{a / b:5.2f}"


def row_line(name: str, spec: str, target: str, r: dict) -> str:
    """One case's line: times in ms, measured / predicted ratios."""
    def ms(k: str, w: int = 6) -> str:
        return f"{1e3 * r[k]:{w}.1f}"

    def part(k: str) -> str:
        return f"{ms(k)} {ms(k + '_pred')} {ratio(r[k], r[k + '_pred'])}"

    rate = r["moved"] / r["update"] / 1e9 if r["update"] and r["moved"] else 0.0
    kind = "stream" if "parameters" in spec else "offload" if "offload" in spec else "device"
    return (f"{name:<14} {kind:<7} {target:<6} "
            f"{r['arena'] / 2**20:6.1f}Mi {r['slowdown']:4.0f} | {part('step')} | "
            f"{part('device')} {ms('device_cpu')} {ratio(r['device'], r['device_cpu'])} | "
            f"{part('stall')} {ms('stall_cpu')} {ratio(r['stall'], r['stall_cpu'])} | "
            f"{ms('update')} {ms('update_pred', 5)} {ratio(r['update'], r['update_pred'])} "
            f"{rate:4.1f} | {part('back')} {ms('back_cpu')} {ratio(r['back'], r['back_cpu'])}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per case first")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case (median)")
    ap.add_argument("--quick", action="store_true", help="the first GPT on v100 only")
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    ap.add_argument("--targets", default=None, help="comma-separated subset: v100,titanx,slow")
    args = ap.parse_args(argv)
    models = MODELS[:1] if args.quick else MODELS
    if args.models:
        models = [m for m in MODELS if m[0] in args.models.split(",")]
    names = {"v100": "v100", "titanx-maxwell": "titanx", SLOW_LINK: "slow"}
    targets = TARGETS[:1] if args.quick else TARGETS
    if args.targets:
        targets = [t for t in TARGETS if names[t] in args.targets.split(",")]
    print(f"slow link: {SLOW_LINK}; {args.warmup} untimed then {args.steps} timed steps per "
          "case (medians); ms on this CPU; m/p = measured / predicted (device and back: the "
          "model on the target x the step's slowdown; update: the host rate "
          f"{HOST_UPDATE_BYTES_PER_S / 1e9:.1f} GB/s, unscaled)")
    print(f"{'model':<14} {'spec':<7} {'target':<6} {'arena':>8} {'slow':>4} | "
          f"{'step':>6} {'pred':>6} {'m/p':>5} | {'device':>6} {'pred':>6} {'m/p':>5} "
          f"{'cpu-t':>6} {'m/c':>5} | {'stall':>6} {'pred':>6} {'m/p':>5} {'cpu-t':>6} "
          f"{'m/c':>5} | {'update':>6} {'pred':>5} {'m/p':>5} {'GB/s':>4} | {'back':>6} "
          f"{'pred':>6} {'m/p':>5} {'cpu-t':>6} {'m/c':>5}")
    t_start = time.perf_counter()
    for name, config, batch in models:
        for target in targets:
            for spec in SPECS:
                print(row_line(name, spec, names[target],
                               run_case(config, batch, spec, target, args.warmup, args.steps)),
                      flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
