"""Step time of two installs of minidl, alternated in separate processes (Part 20's gate).

The "before" side is a non-editable install of an older commit on ``PYTHONPATH``; the "after"
side is the minidl this interpreter imports. Each round runs ``minidl bench MODEL --json`` once
per side, in alternating order; medians over the rounds are compared (speed = before / after).

    git worktree add /tmp/before OLD_COMMIT
    pip install --no-deps --no-build-isolation --target /tmp/before_site /tmp/before
    python benchmarks/step_gate.py --before-site /tmp/before_site --rounds 7 smallcnn gpt-char
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


def step_ms(before_site: str | None, args: list[str], steps: int) -> float:
    """Median step time (ms) of one ``minidl bench`` run in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if before_site:
        env["PYTHONPATH"] = before_site
    out = subprocess.run([sys.executable, "-m", "minidl", "bench", *args, "--json", "--steps",
                          str(steps), "--warmup", "3"], cwd="/", env=env, capture_output=True,
                         text=True, check=True).stdout
    return 1000 * float(json.loads(out)["results"][0]["step_time_median_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--before-site", required=True, help="folder of the older install")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    for name in a.workloads:
        args, steps = WORKLOADS[name]
        times: dict[str, list[float]] = {"before": [], "after": []}
        for r in range(a.rounds):
            for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
                site = a.before_site if side == "before" else None
                times[side].append(step_ms(site, args, steps))
        b, f = statistics.median(times["before"]), statistics.median(times["after"])
        print(json.dumps({"workload": name, "before_ms": round(b, 2), "after_ms": round(f, 2),
                          "speed_after_over_before": round(b / f, 3), "rounds": a.rounds,
                          "before_all": times["before"], "after_all": times["after"]}),
              flush=True)


if __name__ == "__main__":
    main()
