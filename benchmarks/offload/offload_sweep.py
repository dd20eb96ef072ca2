"""The largest GPT that plans on one 32 GB V100 with ``offload=optimizer`` (issue 47).

GPT shapes of the GPT-3 paper's family (Brown et al. 2020, Table 2.1: 1.3 B is 24 layers of
2048, 2.7 B 32 of 2560, 6.7 B 32 of 4096, 13 B 40 of 5120 (the paper's 5140 is not a
multiple of its 40 heads; 5120 is what implementations use)) and depths of 4096 between
6.7 B and 13 B, and of 5120 past 13 B, to find the edge; context 1024, vocabulary 50257.
Each is planned by ``minidl plan`` in its own process (models are built with deferred parameters)::

    PYTHONPATH=benchmarks/offload python -m minidl plan offload_sweep:gpt_6_7b --target v100-32gb \\
        --memory auto,budget=32GiB --optimizer adam --host-memory 512GiB --batch-size 1 --json

and the row records: fits or not, the device peak, the host bytes, the predicted step time
(the device's iteration plus the host update and the parameters' copy back: the whole step)
and TFLOP/s per GPU from the model FLOPs 6 x parameters x tokens (Kaplan et al.'s count,
the one ZeRO-Offload's figures use; attention's own FLOPs left out). ZeRO-Offload (Ren et
al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021): a 13 B
model on one 32 GB V100, ~40 TFLOP/s per GPU at 10 B.

    python benchmarks/offload/offload_sweep.py [--precision fp16-mixed] [--models gpt_1_3b,...]
        [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from minidl.net.deferred_init import deferred_parameters
from minidl.zoo.transformers import TransformerConfig, gpt

#: name -> (layers, heads, width): the GPT-3 family's, depths of 4096 between, of 5120 past.
SHAPES: dict[str, tuple[int, int, int]] = {
    "gpt_1_3b": (24, 16, 2048),
    "gpt_2_7b": (32, 32, 2560),
    "gpt_6_7b": (32, 32, 4096),
    "gpt_7_5b": (36, 32, 4096),
    "gpt_7_9b": (38, 32, 4096),
    "gpt_8_3b": (40, 32, 4096),
    "gpt_10b": (50, 32, 4096),
    "gpt_13b": (40, 40, 5120),
    "gpt_14b": (44, 40, 5120),
    "gpt_15b": (48, 40, 5120),
    "gpt_16b": (50, 40, 5120),
    "gpt_20b": (44, 48, 6144),
    "gpt_26b": (57, 48, 6144),
    "gpt_30b": (66, 48, 6144),
}
CONTEXT, VOCAB = 1024, 50257
BUDGET = 32 << 30


def _config(name: str) -> TransformerConfig:
    layers, heads, dim = SHAPES[name]
    return TransformerConfig(layers, heads, dim, CONTEXT, VOCAB, dropout=0.1, gelu="tanh")


def parameters(name: str) -> int:
    """Trainable parameters of ``name``, counted by the network itself (built with deferred
    parameters: shapes only, no values drawn)."""
    with deferred_parameters():
        return gpt(_config(name)).num_parameters()


def _builder(name: str):
    def build():
        return gpt(_config(name), name=name.replace("_", "-"))
    build.__doc__ = f"GPT {SHAPES[name]} (layers, heads, width), context 1024, vocab 50257."
    return build


for _name in SHAPES:
    globals()[_name] = _builder(_name)


def plan_row(name: str, precision: str, batch: int, timeout_s: float) -> dict:
    """``minidl plan`` of ``name`` in its own process, timed (and its max RSS)."""
    cmd = ["/usr/bin/time", "-f", "maxrss_kb=%M", sys.executable, "-m", "minidl", "plan",
           f"offload_sweep:{name}", "--target", "v100-32gb", "--memory", "auto,budget=32GiB",
           "--optimizer", "adam", "--host-memory", "512GiB", "--batch-size", str(batch),
           "--precision", precision, "--json"]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"model": name, "fits": None, "error": f"timeout {timeout_s:.0f} s"}
    row = {"model": name, "precision": precision, "batch": batch, "params": parameters(name),
           "plan_s": round(time.perf_counter() - t0, 1), "rc": p.returncode}
    for line in p.stderr.splitlines():
        if line.startswith("maxrss_kb="):
            row["maxrss_mib"] = round(int(line.split("=")[1]) / 1024)
    try:
        rep = json.loads(p.stdout)
    except json.JSONDecodeError:
        row["fits"] = False
        row["error"] = next((ln for ln in p.stderr.splitlines() if ln.startswith("minidl:")),
                            p.stderr[-300:])[:300]
        return row
    pred, host = rep.get("prediction", {}), rep.get("host_update", {})
    device_s = pred.get("step_s", 0.0)
    step_s = device_s + host.get("host_update_s", 0.0) + host.get("parameter_upload_s", 0.0)
    flops = 6 * row["params"] * batch * CONTEXT
    row.update(fits=p.returncode == 0 and rep["peak_reserved_bytes"] <= BUDGET,
               peak_bytes=rep["peak_reserved_bytes"],
               persistent_bytes=rep["persistent_bytes"], host_bytes=rep.get("host_bytes", 0),
               device_step_s=device_s, host_update_s=host.get("host_update_s", 0.0),
               upload_s=host.get("parameter_upload_s", 0.0), step_s=step_s,
               oracle_s=pred.get("oracle_s"), model_flops=flops,
               tflops=flops / step_s / 1e12 if step_s else None)
    return row


def _run(r: dict) -> str:
    return f"{r.get('precision', '?')}, {r.get('batch', '?')}"


def format_row(r: dict) -> str:
    gib = 2 ** 30
    if not r.get("peak_bytes"):
        return (f"| {r['model']} | {r.get('params', 0) / 1e9:.2f} B | {_run(r)} | no | - | - | "
                f"- | - | {r.get('plan_s', '-')} s, {r.get('maxrss_mib', '?')} MiB | "
                f"{r.get('error', '')[:200]} |")
    return (f"| {r['model']} | {r['params'] / 1e9:.2f} B | {_run(r)} | "
            f"{'yes' if r['fits'] else 'no'} | "
            f"{r['peak_bytes'] / gib:.2f} GiB | {r['host_bytes'] / gib:.1f} GiB | "
            f"{r['step_s']:.2f} s ({r['device_step_s']:.2f} + {r['host_update_s']:.2f} + "
            f"{r['upload_s']:.2f}) | {r['tflops']:.1f} | {r['plan_s']} s, "
            f"{r.get('maxrss_mib', '?')} MiB | |")


def _print_table(path: str) -> int:
    print(HEADER)
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "peak_bytes" in row:
                row["fits"] = row["rc"] == 0 and row["peak_bytes"] <= BUDGET
            print(format_row(row))
    return 0


HEADER = ("| model | parameters | precision, batch | fits | device peak | host | step (device "
          "+ host update + upload) | TFLOP/s | planning (time, max RSS) | note |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per plan")
    ap.add_argument("--out", default=None, help="append each row as a JSON line")
    ap.add_argument("--table", default=None, help="print the table of these JSON lines")
    args = ap.parse_args(argv)
    if args.table:
        return _print_table(args.table)
    print(HEADER, flush=True)
    for name in args.models.split(","):
        row = plan_row(name, args.precision, args.batch_size, args.timeout)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(format_row(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
