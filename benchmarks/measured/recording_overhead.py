"""What recording a run's memory costs: ``Trainer.step`` with and without
``Trainer.record_memory()`` on the same trainer, in alternating blocks.

    python benchmarks/measured/recording_overhead.py            # smallcnn and vgg11, 3x32x32
    python benchmarks/measured/recording_overhead.py --quick    # fewer rounds

Per model: after ``--warmup`` steps, ``--rounds`` rounds of ``--block`` steps without recording
then ``--block`` steps inside ``record_memory()`` (the order alternates between rounds); the
median step time of each, and the ratio. Step times on a loaded machine vary by more than
recording costs, so the cost itself is also measured where nothing else runs: the same
iteration on the meta device (memory actions only, no compute), ``--meta-rounds`` steps each
way; ``added`` is the difference of the medians, and ``added / plain`` the overhead it means
on the real step. Recording notes every block event and plan action with
``time.perf_counter()`` and keeps the iteration with the highest peak; the snapshot is built
only when asked for (not timed here: once per run).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import minidl
from minidl.net.optim import SGD
from minidl.zoo.models import smallcnn, vgg

MODELS = [
    ("smallcnn", lambda: smallcnn((3, 32, 32), 10), 64),
    ("vgg11", lambda: vgg(11, (3, 32, 32), 10), 32),
]


def steps(tr: minidl.Trainer, x: np.ndarray, y: np.ndarray, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        tr.step(x, y)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", default="reuse,inplace,swap=conv")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--meta-rounds", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.block = 4, 1
    print(f"memory {args.memory!r}; {args.rounds} rounds of {args.block} steps each way")
    print(f"{'model':<10}{'batch':>6}{'plain ms':>11}{'recorded ms':>13}{'ratio':>8}"
          f"{'added us':>10}{'added/plain':>13}")
    for name, build, batch in MODELS:
        net = build()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                            memory=args.memory, device_memory="1GiB")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch, 3, 32, 32)).astype(np.float32)
        y = rng.integers(0, 10, batch)
        steps(tr, x, y, args.warmup)
        plain: list[float] = []
        recorded: list[float] = []
        for r in range(args.rounds):
            for record in ((False, True) if r % 2 == 0 else (True, False)):
                if record:
                    with tr.record_memory():
                        recorded += steps(tr, x, y, args.block)
                else:
                    plain += steps(tr, x, y, args.block)
        a, b = statistics.median(plain), statistics.median(recorded)
        added = meta_cost(build, x, y, args.memory, args.meta_rounds)
        print(f"{name:<10}{batch:>6}{1000 * a:>11.1f}{1000 * b:>13.1f}{b / a:>8.3f}"
              f"{1e6 * added:>10.0f}{100 * added / a:>12.3f}%", flush=True)


def meta_cost(build, x: np.ndarray, y: np.ndarray, memory: str, rounds: int) -> float:
    """Seconds recording adds to one iteration, measured on the meta device (the same memory
    actions and events, no compute): median recorded step - median plain step."""
    net = build()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01), memory=memory, device="meta",
                        device_memory="1GiB")
    steps(tr, x, y, 5)
    plain: list[float] = []
    recorded: list[float] = []
    for _ in range(rounds):
        plain += steps(tr, x, y, 1)
        with tr.record_memory():
            recorded += steps(tr, x, y, 1)
    return statistics.median(recorded) - statistics.median(plain)


if __name__ == "__main__":
    main()
