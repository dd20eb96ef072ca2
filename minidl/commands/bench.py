"""``minidl bench``: median step time and peak per memory spec (and PyTorch's, optionally)."""

from __future__ import annotations

import argparse
import functools
import json

from ..memory.ir.names import DeviceKind
from ..memory.ir.units import format_size
from ..tools.bench import run_bench
from .common import (
    UsageError,
    build_model,
    check_device,
    emulated_target,
    parse_memory,
    shape_and_classes,
)


def cmd_bench(args: argparse.Namespace) -> int:
    specs = [parse_memory(s) for s in args.memory]
    link = None if args.emulate_link is None else emulated_target(args.emulate_link)
    if link is not None and args.device != DeviceKind.CPU:
        raise UsageError(f"--emulate-link throttles the cpu device's copy engine: it needs "
                         f"--device cpu, not {args.device}")
    check_device(args.device)
    shape, classes = shape_and_classes(args)
    net0 = build_model(args.model, shape, classes, args.width)
    shape = shape or net0.input_shapes[0]
    result = run_bench(  # a partial, not a lambda: PyTorch builds it in its own process
        functools.partial(build_model, args.model, shape, classes, args.width), shape,
        args.batch_size, specs, steps=args.steps, warmup=args.warmup,
        compare_torch=args.compare_torch, seed=args.seed, progress=not args.json,
        emulate_link=link, device=args.device, precision=args.precision,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print_bench(args, shape, result)
    return 0


def print_bench(args: argparse.Namespace, shape, result: dict) -> None:
    """The table of ``minidl bench``: one meaning per column, said by its header. "x first"
    is a row's median step time over the first spec's, PyTorch's row included; how minidl
    compares with PyTorch has its own line under the table."""
    first = result["results"][0]
    print(f"{args.model}, input {'x'.join(map(str, shape))}, batch {args.batch_size}, "
          f"{args.steps} steps per spec (median), device {args.device}, "
          f"precision {result.get('precision', 'fp32')}")
    print(f"{'memory spec':<36}{'peak allocated':>18}{'step (ms)':>12}{'x first':>9}")
    for r in result["results"]:
        extra = ""
        if "swap" in r:
            s = r["swap"]
            extra = (f"   offloaded {format_size(s['offloaded_bytes'])}, stall "
                     f"{1000 * s['stall_s']:.2f} ms, cache hits {s['cache_hits']}")
        if "recompute" in r:
            extra += f"   recomputed {1000 * r['recompute']['time_s']:.1f} ms"
        if "link_emulation" in r and r["link_emulation"]["slowdown"] is not None:
            e = r["link_emulation"]
            extra += (f"   {e['target']} link emulated: {e['slowdown']:.0f}x slower "
                      f"compute, {e['link_bytes_per_s'] / 1e6:.1f} MB/s")
        for b in r.get("bptt", []):
            extra += (f"   {b['layer']}: {b['states_kept']} states, "
                      f"{b['unit_forwards'] / b['units']:.2f} forwards/unit")
        print(f"{r['spec']:<36}{format_size(r['peak_allocated_bytes']):>18}"
              f"{1000 * r['step_time_median_s']:>12.2f}{r['time_ratio']:>9.3f}{extra}")
    torch = result.get("torch")
    if torch is not None:
        who = f"pytorch ({torch['device']})"
        over_first = torch["step_time_median_s"] / first["step_time_median_s"]
        print(f"{who:<36}{'':>18}{1000 * torch['step_time_median_s']:>12.2f}"
              f"{over_first:>9.3f}")
    print(f"x first: median step time over the first spec's ({first['spec']})")
    if torch is not None:
        print(f"minidl with {first['spec']} takes {torch['time_ratio']:.3f}x PyTorch's step "
              "time" + (" (slower)" if torch["time_ratio"] > 1 else " (faster or equal)"))
