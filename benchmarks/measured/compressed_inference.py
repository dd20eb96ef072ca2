"""Inference from a compressed model file (``minidl compress``) on a dataset's test split: the
accuracy, the real run's device peak, the peak ``minidl plan --inference --compressed`` plans,
and the dense weights' bytes, as one JSON object.

    python benchmarks/measured/compressed_inference.py lenet5.mdc --dataset mnist --batch-size 1
"""
from __future__ import annotations

import argparse
import json
import time

from minidl.compression import CompressedRunner, plan_inference, read
from minidl.datasets import data as D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None, help="first N test images only")
    args = ap.parse_args()
    cm = read(args.file)
    ds = D.load_dataset(args.dataset)
    if cm.preprocess.get("mean") is not None:
        ds.standardize()  # as the file's model was trained
    x, y = ds.x_test[:args.limit], ds.y_test[:args.limit]
    planned = plan_inference(cm, args.batch_size)
    runner = CompressedRunner(cm)
    t0 = time.perf_counter()
    logits = runner.predict(x, args.batch_size)
    seconds = time.perf_counter() - t0
    stats = runner.pool.stats()
    print(json.dumps({
        "file": args.file, "model": cm.model["name"], "images": len(x),
        "batch_size": args.batch_size, "accuracy": float((logits.argmax(1) == y).mean()),
        "real_peak_allocated_bytes": stats["allocated_bytes.peak"],
        "planned_peak_allocated_bytes": planned["peak_allocated_bytes"],
        "dense_weight_bytes": planned["dense_weight_bytes"],
        "compressed_record_bytes": planned["compressed_record_bytes"],
        "peak_step": planned["peak_step"], "seconds": round(seconds, 2)}))


if __name__ == "__main__":
    main()
