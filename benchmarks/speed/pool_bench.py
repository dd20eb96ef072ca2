"""Pool benchmark: replay a synthetic VGG-16 training-iteration trace.

The trace is synthetic: feature-map, gradient-map, stash and workspace sizes of one VGG-16
iteration (batch 32, 3x224x224 by default) computed here by hand, in a liveness order (forward
allocates each layer's output and a workspace freed right after; backward allocates gradient
maps, frees each gradient after use and each stash/feature map after its last use). Parameters,
gradients and momentum are allocated once before the replays. No compute is done.

Reports µs per allocate+free pair for the Pool (meta and cpu devices) versus ``numpy.empty`` of
the same sizes, and, for best-fit and first-fit, reserved/allocated at the peak and the pool's
fragmentation at the allocated peak in the tightest arena (capacity = reserved peak).

    python benchmarks/speed/pool_bench.py            # defaults: batch 32, 224x224, 5 repetitions
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from minidl.memory import CpuDevice, MetaDevice, Pool, format_size
from minidl.memory.devices.device import available_host_memory

VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
F32 = 4

Event = tuple  # ("alloc", key, nbytes, tag, category) | ("free", key)


Layer = tuple  # (kind, name, cin, cout, h, w): h, w the input's spatial size


def _alloc(ev: list[Event], key: str, nbytes: int, cat: str) -> str:
    ev.append(("alloc", key, int(nbytes), key, cat))
    return key


def _free(ev: list[Event], key: str) -> None:
    ev.append(("free", key))


def vgg16_layers(image: int, classes: int = 1000) -> list[Layer]:
    """VGG-16's convolutions, pools and fully connected layers on ``image`` x ``image``."""
    layers: list[Layer] = []
    c, h, i, j = 3, image, 0, 0
    for v in VGG16:
        if v == "M":
            j += 1
            layers.append(("pool", f"pool{j}", c, c, h, h))
            h //= 2
        else:
            i += 1
            layers.append(("conv", f"conv{i}", c, int(v), h, h))
            c = int(v)
    flat = c * h * h
    for k, (cin, cout) in enumerate([(flat, 4096), (4096, 4096), (4096, classes)]):
        layers.append(("fc", f"fc{6 + k}", cin, cout, 1, 1))
    return layers


def persistent_events(layers: list[Layer]) -> list[Event]:
    """Parameters, gradients and momentum of every layer with weights."""
    setup: list[Event] = []
    for kind, name, cin, cout, _, _ in layers:
        if kind == "pool":
            continue
        wsize = cin * cout * (9 if kind == "conv" else 1) * F32
        for suffix, cat in ((".w", "parameter"), (".b", "parameter"), (".w.grad", "gradient"),
                            (".b.grad", "gradient"), (".w.mom", "optimizer_state"),
                            (".b.mom", "optimizer_state")):
            _alloc(setup, name + suffix, wsize if ".w" in suffix else cout * F32, cat)
    return setup


def _forward_layer(it: list[Event], layer: Layer, batch: int) -> tuple[str, list[str]]:
    """One layer's forward events: (its output's key, the keys it stashes for backward)."""
    kind, name, cin, cout, hh, ww = layer
    if kind == "conv":
        out = _alloc(it, f"{name}.out", batch * cout * hh * ww * F32, "feature_map")
        ws = _alloc(it, f"{name}.ws", cin * 9 * hh * ww * F32, "workspace")  # im2col, 1 sample
        _free(it, ws)
        return out, []  # ReLU in place: the output's sign is read from the output
    if kind == "pool":
        n = batch * cout * (hh // 2) * (ww // 2)
        out = _alloc(it, f"{name}.out", n * F32, "feature_map")
        return out, [_alloc(it, f"{name}.argmax", n, "stash")]  # 2x2 window index
    out = _alloc(it, f"{name}.out", batch * cout * F32, "feature_map")
    return out, [] if name == "fc8" else [_alloc(it, f"{name}.mask", batch * cout,
                                                 "stash")]  # dropout mask


def _backward(it: list[Event], layers: list[Layer], outs: list[str],
              stash: dict[str, list[str]], batch: int, classes: int) -> None:
    """Backward's events, from the loss's gradient down to the first layer."""
    grad = _alloc(it, "fc8.out.grad", batch * classes * F32, "gradient_map")
    _free(it, "loss.probs")
    for idx in range(len(layers) - 1, -1, -1):
        kind, name, cin, cout, hh, ww = layers[idx]
        for s in stash[name]:  # ReLU/dropout backward (in place on grad), pool's argmax
            if kind != "pool":
                _free(it, s)
        if outs[idx]:
            _free(it, outs[idx])  # last use: this layer's activation backward
        if idx == 0:  # no gradient for the data
            ws = _alloc(it, f"{name}.bws", cin * 9 * hh * ww * F32, "workspace")
            _free(it, ws)
            _free(it, grad)
            break
        in_bytes = batch * cin * hh * ww * F32
        g_in = _alloc(it, f"{layers[idx - 1][1]}.out.grad", in_bytes, "gradient_map")
        if kind == "conv":
            ws = _alloc(it, f"{name}.bws", cin * 9 * hh * ww * F32, "workspace")
            _free(it, ws)
        for s in stash[name]:
            if kind == "pool":
                _free(it, s)
        _free(it, grad)
        grad = g_in


def vgg16_trace(batch: int, image: int, classes: int = 1000) -> tuple[list[Event], list[Event]]:
    """(setup events for persistent state, events of one training iteration)."""
    layers = vgg16_layers(image, classes)
    it: list[Event] = []
    x = _alloc(it, "data", batch * 3 * image * image * F32, "input")
    labels = _alloc(it, "labels", batch * 8, "input")
    outs: list[str] = []
    stash: dict[str, list[str]] = {}
    for layer in layers:
        out, stash[layer[1]] = _forward_layer(it, layer, batch)
        outs.append(out)
    _alloc(it, "loss.probs", batch * classes * F32, "stash")
    _free(it, outs[-1])  # logits: softmax-CE backward needs only the probabilities
    outs[-1] = ""
    _backward(it, layers, outs, stash, batch, classes)
    _free(it, x)
    _free(it, labels)
    return persistent_events(layers), it


def replay_pool(pool: Pool, trace: list[Event], live: dict[str, Any]) -> None:
    allocate, free = pool.allocate, pool.free
    for ev in trace:
        if ev[0] == "alloc":
            live[ev[1]] = allocate(ev[2], ev[3], ev[4])
        else:
            free(live.pop(ev[1]))


def replay_pool_views(pool: Pool, trace: list[Event], live: dict[str, Any]) -> None:
    allocate, free, u8 = pool.allocate, pool.free, np.uint8
    views = {}
    for ev in trace:
        if ev[0] == "alloc":
            blk = live[ev[1]] = allocate(ev[2], ev[3], ev[4])
            views[ev[1]] = blk.view((ev[2],), u8)
        else:
            del views[ev[1]]
            free(live.pop(ev[1]))


def replay_numpy(trace: list[Event], live: dict[str, Any]) -> None:
    empty, u8 = np.empty, np.uint8
    for ev in trace:
        if ev[0] == "alloc":
            live[ev[1]] = empty((ev[2],), u8)
        else:
            del live[ev[1]]


def time_per_pair(fn: Any, trace: list[Event], iters: int, reps: int) -> list[float]:
    pairs = sum(1 for ev in trace if ev[0] == "alloc") * iters
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(trace)
        out.append((time.perf_counter() - t0) / pairs * 1e6)
    return out


def fragmentation_at_peak(policy: str, setup: list[Event], trace: list[Event]) -> dict[str, Any]:
    # Dry run to learn the reserved peak, then the same trace in the tightest arena.
    dry = Pool(MetaDevice(), policy=policy)
    live: dict[str, Any] = {}
    replay_pool(dry, setup, live)
    replay_pool(dry, trace, live)
    replay_pool(dry, trace, live)  # a second iteration: steady state
    s = dry.stats()
    tight = Pool(MetaDevice(s["reserved_bytes.peak"]), policy=policy)
    live = {}
    replay_pool(tight, setup, live)
    frag, peak, free = 0.0, -1, 0
    for _ in range(2):
        for ev in trace:
            if ev[0] == "alloc":
                live[ev[1]] = tight.allocate(ev[2], ev[3], ev[4])
                if tight.allocated_bytes > peak:
                    peak = tight.allocated_bytes
                    st = tight.stats()
                    frag, free = st["fragmentation"], st["free_bytes"]
            else:
                tight.free(live.pop(ev[1]))
    return {"allocated_peak": s["allocated_bytes.peak"],
            "reserved_peak": s["reserved_bytes.peak"], "frag_at_peak": frag,
            "free_at_peak": free, "at_peak": dry.stats_at_peak()["by_category"]}


def random_trace(sizes: list[int], n: int, seed: int = 0) -> list[Event]:
    """Random lifetimes (each step frees a random live block with probability 1/2)."""
    rng = np.random.default_rng(seed)
    out: list[Event] = []
    live: list[str] = []
    for k in range(n):
        if live and rng.random() < 0.5:
            out.append(("free", live.pop(int(rng.integers(len(live))))))
        else:
            key = f"r{k}"
            out.append(("alloc", key, int(rng.choice(sizes)), key, "workspace"))
            live.append(key)
    out.extend(("free", key) for key in live)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--iters", type=int, default=1000, help="iterations replayed per repetition")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cpu-batch", type=int, default=8, help="batch of the cpu-arena run")
    ap.add_argument("--cpu-image", type=int, default=64, help="image size of the cpu-arena run")
    args = ap.parse_args()

    setup, trace = vgg16_trace(args.batch, args.image)
    n_alloc = sum(1 for ev in trace if ev[0] == "alloc")
    print(f"synthetic VGG-16 trace, batch {args.batch}, 3x{args.image}x{args.image}: "
          f"{len(setup)} persistent blocks, {n_alloc} allocate+free pairs per iteration; "
          f"{args.iters} iterations x {args.reps} repetitions (median)")

    rows = []
    for policy in ("best_fit", "first_fit"):
        pool = Pool(MetaDevice(), policy=policy)
        live: dict[str, Any] = {}
        replay_pool(pool, setup, live)
        t = time_per_pair(lambda tr, p=pool, lv=live: replay_pool(p, tr, lv), trace, args.iters,
                          args.reps)
        rows.append((f"Pool {policy}, meta device", statistics.median(t)))

    # cpu arena: a smaller input so the arena (sized by a dry run) fits any machine
    csetup, ctrace = vgg16_trace(args.cpu_batch, args.cpu_image)
    dry = Pool(MetaDevice())
    live = {}
    replay_pool(dry, csetup, live)
    replay_pool(dry, ctrace, live)
    need = dry.stats()["reserved_bytes.peak"]
    if need <= available_host_memory() // 2:
        with CpuDevice(need) as dev:
            pool = Pool(dev)
            live = {}
            replay_pool(pool, csetup, live)
            t = time_per_pair(lambda tr: replay_pool(pool, tr, live), ctrace, args.iters,
                              args.reps)
            rows.append((f"Pool best_fit, cpu arena {format_size(need)} (batch {args.cpu_batch}, "
                         f"{args.cpu_image}px)", statistics.median(t)))
            t = time_per_pair(lambda tr: replay_pool_views(pool, tr, live), ctrace, args.iters,
                              args.reps)
            assert pool.stats()["reserved_bytes.peak"] == need  # dry run == real run
        rows.append(("  the same, + a uint8 view of each block (Block.view)", statistics.median(t)))
        t = time_per_pair(lambda tr: replay_numpy(tr, {}), ctrace, args.iters, args.reps)
        rows.append((f"numpy.empty, same sizes (batch {args.cpu_batch}, {args.cpu_image}px)",
                     statistics.median(t)))
    t = time_per_pair(lambda tr: replay_numpy(tr, {}), trace, max(1, args.iters // 4), args.reps)
    rows.append((f"numpy.empty, same sizes (batch {args.batch}, {args.image}px)",
                 statistics.median(t)))

    print()
    print(f"{'allocator':<78} {'us/pair':>8}")
    for name, us in rows:
        print(f"{name:<78} {us:8.2f}")

    print()
    print(f"{'policy':<10} {'allocated peak':>24} {'reserved peak':>24} {'reserved/alloc':>15} "
          f"{'frag at peak':>13} {'free at peak':>14}")
    for policy in ("best_fit", "first_fit"):
        r = fragmentation_at_peak(policy, setup, trace)
        print(f"{policy:<10} {format_size(r['allocated_peak']):>11} ({r['allocated_peak']:>11}) "
              f"{format_size(r['reserved_peak']):>11} ({r['reserved_peak']:>11}) "
              f"{r['reserved_peak'] / r['allocated_peak']:>15.4f} {r['frag_at_peak']:>13.4f} "
              f"{format_size(r['free_at_peak']):>14}")
    sizes = [ev[2] for ev in trace if ev[0] == "alloc"]
    rtrace = random_trace(sizes, 4000)
    n_r = sum(1 for ev in rtrace if ev[0] == "alloc")
    print(f"\nfor contrast, random lifetimes: {n_r} blocks with sizes drawn from the trace above")
    for policy in ("best_fit", "first_fit"):
        r = fragmentation_at_peak(policy, [], rtrace)
        print(f"{policy:<10} {format_size(r['allocated_peak']):>11} ({r['allocated_peak']:>11}) "
              f"{format_size(r['reserved_peak']):>11} ({r['reserved_peak']:>11}) "
              f"{r['reserved_peak'] / r['allocated_peak']:>15.4f} {r['frag_at_peak']:>13.4f} "
              f"{format_size(r['free_at_peak']):>14}")
    print()
    print("bytes by category at the allocated peak (best_fit):")
    for cat, n in sorted(fragmentation_at_peak("best_fit", setup, trace)["at_peak"].items(),
                         key=lambda kv: -kv[1]):
        print(f"  {cat:<16} {format_size(n):>11}")


if __name__ == "__main__":
    main()
