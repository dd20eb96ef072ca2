"""Step time of two installs of minidl, alternated in separate processes (Part 20's gate).

The "before" side is a non-editable install of an older commit on ``PYTHONPATH``; the "after"
side is the minidl this interpreter imports. Each round runs ``minidl bench MODEL --json`` once
per side, in alternating order; medians over the rounds are compared (speed = before / after).

``--clock cpu`` measures what a loaded machine disturbs least: each child runs the steps on one
thread (``MINIDL_NUM_THREADS=1``) and times them with the process's CPU time, which does not
count the time other processes hold the cores; its median over 40 steps is one round's figure.

    git worktree add /tmp/before OLD_COMMIT
    pip install --no-deps --no-build-isolation --target /tmp/before_site /tmp/before
    python benchmarks/gates/step_gate.py --before-site /tmp/before_site --rounds 7 smallcnn gpt-char
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKLOADS = {
    "smallcnn": (["smallcnn", "--batch-size", "64"], 80),
    "vgg11": (["vgg11", "--input", "3x32x32", "--batch-size", "32"], 15),
    "char-lstm": (["char-lstm", "--batch-size", "32", "--seq-len", "64"], 30),
    "gpt-char": (["gpt-char", "--batch-size", "8", "--seq-len", "64"], 25),
}


def run_child(before_site: str | None, argv: list[str], **env_vars: str) -> str:
    """The stdout of ``python argv`` in a fresh process importing the "before" install
    (``before_site``) or, with None, this interpreter's minidl; ``env_vars`` added."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_vars)
    if before_site:
        env["PYTHONPATH"] = before_site
    return subprocess.run([sys.executable, *argv], cwd="/", env=env, capture_output=True,
                          text=True, check=True).stdout


def step_ms(before_site: str | None, args: list[str], steps: int) -> float:
    """Median step time (ms) of one ``minidl bench`` run in a fresh process."""
    out = run_child(before_site, ["-m", "minidl", "bench", *args, "--json", "--steps",
                                  str(steps), "--warmup", "3"])
    return 1000 * float(json.loads(out)["results"][0]["step_time_median_s"])


#: One child of ``--clock cpu``: the workload's trainer built as ``minidl bench`` builds it
#: (through names both installs have), its steps timed by the process's CPU clock.
CPU_CHILD = """
import json, statistics, sys, time
import minidl
from minidl import Trainer
from minidl.net.optim import SGD
from minidl.cli import build_parser
from minidl.commands.common import build_model, shape_and_classes
from minidl.tools.bench import synthetic_batch
from minidl.analysis.dryrun import auto_device_memory
steps = int(sys.argv[1])
args = build_parser().parse_args(["bench", *sys.argv[2:]])
shape, classes = shape_and_classes(args)
net = build_model(args.model, shape, classes, args.width)
shape = shape or net.input_shapes[0]
cap = auto_device_memory(net, args.batch_size, "none", "sgd", shape, device_kind="cpu")
trainer = Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory="none",
                  device_memory=cap, seed=0)
x, y = synthetic_batch(net, shape, args.batch_size, 0)
for _ in range(3):
    trainer.step(x, y)
times = []
for _ in range(steps):
    t0 = time.process_time()
    trainer.step(x, y)
    times.append(time.process_time() - t0)
print(json.dumps({"median_s": statistics.median(times), "min_s": min(times),
                  "minidl": minidl.__file__}))
"""


def cpu_step_ms(before_site: str | None, args: list[str], steps: int) -> float:
    """Median single-thread CPU time (ms) of a step, in a fresh process (:data:`CPU_CHILD`)."""
    out = run_child(before_site, ["-c", CPU_CHILD, str(max(steps, 40)), *args],
                    MINIDL_NUM_THREADS="1", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    return 1000 * float(json.loads(out.strip().splitlines()[-1])["median_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--before-site", required=True, help="folder of the older install")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: minidl bench's step time; cpu: one thread's CPU time per step")
    a = ap.parse_args()
    measure = step_ms if a.clock == "wall" else cpu_step_ms
    for name in a.workloads:
        args, steps = WORKLOADS[name]
        times: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(a.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                site = a.before_site if side == "before" else None
                times[side].append(measure(site, args, steps))
        b, f = statistics.median(times["before"]), statistics.median(times["after"])
        print(json.dumps({"workload": name, "before_ms": round(b, 2), "after_ms": round(f, 2),
                          "speed_after_over_before": round(b / f, 3), "rounds": a.rounds,
                          "clock": a.clock,
                          "before_all": times["before"], "after_all": times["after"]}),
              flush=True)


if __name__ == "__main__":
    main()
