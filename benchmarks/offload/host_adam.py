"""Adam on the host cores: minidl's fused Numba kernel against PyTorch's CPU Adam.

One flat float32 group of ``--params`` values (100 M by default: p, g, exp_avg and exp_avg_sq
take 1.6 GB per process) updated in place, as the trainer's flat groups are. Each contender
runs in a process of its own (:class:`~minidl.tools.child_process.ChildProcess`): minidl's
``adam_update`` (kernels/pointwise/optim.py: one pass, ``prange`` over one chunk per thread),
``torch.optim.Adam(fused=True)`` and ``torch.optim.Adam(foreach=True)``. The rounds
alternate them, each round in a rotated order, ``--block`` steps per turn (its first dropped);
reported: the median ms per step, the state moved per step in GB/s (Adam reads p, g, m, v and
writes p, m, v: 28 bytes per float32 value), the ratios minidl/torch (<= 1.0: minidl no
slower) and how far the values drifted apart (every contender ran the same steps). The load
average is printed before and after: on a shared machine run it when quiet. ``--optimizer
adamw`` (weight decay 0.01) and ``sgd`` (momentum 0.9: ``sgd_update`` against
``torch.optim.SGD``, 20 bytes per value) time the other updates the same way.

    python benchmarks/offload/host_adam.py [--params 100000000] [--rounds 5] [--block 4]
                                   [--optimizer adam|adamw|sgd]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from minidl.tools.child_process import SWITCH_PAUSE_S, ChildProcess

#: Bytes of state one step moves per float32 value: Adam reads p, g, m, v and writes p, m, v;
#: SGD with momentum reads p, g, buf and writes p, buf.
BYTES_PER_VALUE = {"adam": 7 * 4, "adamw": 7 * 4, "sgd": 5 * 4}
CONTENDERS = ("minidl", "torch-fused", "torch-foreach")
LR, BETAS, EPS, WEIGHT_DECAY, MOMENTUM = 1e-3, (0.9, 0.999), 1e-8, 0.01, 0.9


class AdamRunner:
    """One contender's flat group of ``n`` float32 values and its ``optimizer`` (``adam``,
    ``adamw`` or ``sgd``), timed step by step in its own process."""

    def __init__(self, contender: str, n: int, optimizer: str = "adam") -> None:
        rng = np.random.default_rng(0)
        p = rng.standard_normal(n, dtype=np.float32)
        g = rng.standard_normal(n, dtype=np.float32)
        self.contender, self.optimizer, self.step_count = contender, optimizer, 0
        if contender == "minidl":
            from minidl.kernels.pointwise.optim import adam_update, sgd_update
            self.adam_update, self.sgd_update = adam_update, sgd_update
            self.p, self.g = p, g
            self.state = [np.zeros_like(p) for _ in range(1 if optimizer == "sgd" else 2)]
            return
        import torch
        self.param = torch.nn.Parameter(torch.from_numpy(p))
        self.param.grad = torch.from_numpy(g)
        fused = contender == "torch-fused"
        kinds = dict(fused=fused, foreach=None if fused else True)
        if optimizer == "sgd":
            self.opt = torch.optim.SGD([self.param], lr=LR, momentum=MOMENTUM, **kinds)
        else:
            cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
            self.opt = cls([self.param], lr=LR, betas=BETAS, eps=EPS,
                           weight_decay=WEIGHT_DECAY if optimizer == "adamw" else 0.0, **kinds)

    def threads(self) -> int:
        if self.contender == "minidl":
            from minidl.kernels.parallel import num_threads
            return num_threads()
        import torch
        return torch.get_num_threads()

    def step(self) -> None:
        if self.contender != "minidl":
            self.opt.step()
            return
        self.step_count += 1
        if self.optimizer == "sgd":
            self.sgd_update(self.p, self.g, self.state[0], LR, MOMENTUM,
                            first_step=self.step_count == 1)
        else:
            adamw = self.optimizer == "adamw"
            self.adam_update(self.p, self.g, *self.state, LR, BETAS[0], BETAS[1], EPS,
                             WEIGHT_DECAY if adamw else 0.0, self.step_count, decoupled=adamw)

    def head(self, count: int) -> np.ndarray:
        """A copy of the first ``count`` parameter values."""
        if self.contender == "minidl":
            return self.p[:count].copy()
        return self.param.detach()[:count].numpy().copy()

    def run(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` updates."""
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t)
        return times


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=100_000_000, help="float32 values")
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds")
    ap.add_argument("--block", type=int, default=4, help="timed steps per turn")
    ap.add_argument("--optimizer", choices=tuple(BYTES_PER_VALUE), default="adam",
                    help="adamw: weight decay 0.01; sgd: momentum 0.9")
    args = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} cores)")
    children = {c: ChildProcess(AdamRunner, c, args.params, args.optimizer, name=c)
                for c in CONTENDERS}
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    try:
        for child in children.values():
            child.call("run", 2)  # (warm-up: the kernel compiled, the pages touched)
        for r in range(args.rounds):
            order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
            for c in order:
                times[c].extend(children[c].call("run", args.block + 1)[1:])
                time.sleep(SWITCH_PAUSE_S)
        threads = {c: children[c].call("threads") for c in CONTENDERS}
        heads = {c: children[c].call("head", 1 << 20) for c in CONTENDERS}
    finally:
        for child in children.values():
            child.close()
    name = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD (momentum)"}[args.optimizer]
    gb = args.params * BYTES_PER_VALUE[args.optimizer] / 1e9
    print(f"{name} over {args.params:,} float32 values ({gb:.2f} GB of state moved per step), "
          f"{args.rounds} rounds x {args.block} steps, each in a process of its own")
    ms = {c: statistics.median(times[c]) * 1e3 for c in CONTENDERS}
    for c in CONTENDERS:
        print(f"  {c:<14} {ms[c]:9.2f} ms/step  {gb / ms[c] * 1e3:6.2f} GB/s  "
              f"({threads[c]} threads; min {min(times[c]) * 1e3:.2f} ms)")
    print(f"ratio minidl/torch-fused   {ms['minidl'] / ms['torch-fused']:.3f}")
    print(f"ratio minidl/torch-foreach {ms['minidl'] / ms['torch-foreach']:.3f}")
    for c in CONTENDERS[1:]:  # (the same steps everywhere; torch's kernels may fuse a * b + c)
        diff = np.abs(heads["minidl"] - heads[c]).max() / np.abs(heads[c]).max()
        print(f"max difference of the first {len(heads[c]):,} values from {c}: {diff:.2e} "
              "of the largest")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return ms


if __name__ == "__main__":
    main()
