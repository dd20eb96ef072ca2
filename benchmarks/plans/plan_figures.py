"""Deterministic memory figures from meta dry runs (no data, no compute), as markdown tables.

    python benchmarks/plans/plan_figures.py            # all tables
    python benchmarks/plans/plan_figures.py --only reuse

Each cell is exactly what ``minidl plan MODEL --input ... --batch-size ... --classes ...
--memory SPEC --json`` reports (the same function runs underneath).
"""

from __future__ import annotations

import argparse

from minidl import dry_run
from minidl.zoo.models import get_model
from minidl.zoo.rnn import char_rnn

GIB = 2**30


def rep(model: str, shape, batch: int, classes: int, spec: str) -> dict:
    return dry_run(get_model(model, shape, classes), batch, spec, input_shape=shape)


def table_reuse() -> None:
    print("### reuse and in-place (ImageNet inputs 3x224x224, batch 64, 1000 classes)\n")
    print("| model | none GiB | reuse,inplace GiB | ratio | lower bound GiB | "
          "reuse,inplace,static reserved / max live |")
    print("|---|---|---|---|---|---|")
    for m in ("vgg16", "alexnet", "resnet50"):
        none = rep(m, (3, 224, 224), 64, 1000, "none")
        ri = rep(m, (3, 224, 224), 64, 1000, "reuse,inplace")
        st = rep(m, (3, 224, 224), 64, 1000, "reuse,inplace,static")
        static_note = next(n for n in st["notes"] if n.startswith("static"))
        ratio = static_note.rsplit("(", 1)[1].rstrip(")")
        print(f"| {m} | {none['peak_allocated_bytes'] / GIB:.3f} | "
              f"{ri['peak_allocated_bytes'] / GIB:.3f} | "
              f"{ri['peak_allocated_bytes'] / none['peak_allocated_bytes']:.1%} | "
              f"{ri['lower_bound_bytes'] / GIB:.3f} | {ratio} |")
    print()


def table_vgg16_specs() -> None:
    print("### vgg16, 3x224x224, batch 64, 1000 classes: every strategy\n")
    print("| memory spec | peak GiB | % of none | peak / lower bound | kept for backward GiB |"
          " host peak GiB |")
    print("|---|---|---|---|---|---|")
    none = rep("vgg16", (3, 224, 224), 64, 1000, "none")
    lb = none["lower_bound_bytes"]
    specs = ["none", "reuse", "reuse,inplace", "reuse,inplace,swap=conv",
             "reuse,inplace,swap=all", "reuse,inplace,recompute=sqrt",
             "reuse,inplace,recompute=speed", "reuse,inplace,recompute=memory",
             "reuse,inplace,recompute=cost", "reuse,inplace,binarize", "gist",
             "reuse,inplace,dpr=fp16", "superneurons", "all"]
    for s in specs:
        r = none if s == "none" else rep("vgg16", (3, 224, 224), 64, 1000, s)
        print(f"| `{s}` | {r['peak_allocated_bytes'] / GIB:.3f} | "
              f"{r['peak_allocated_bytes'] / none['peak_allocated_bytes']:.1%} | "
              f"{r['peak_allocated_bytes'] / lb:.3f} | "
              f"{r['kept_for_backward_bytes'] / GIB:.3f} | "
              f"{r['host_peak_bytes'] / GIB:.3f} |")
    print(f"\nlower bound: {lb / GIB:.3f} GiB\n")


def table_auto() -> None:
    print("### auto with a budget (vgg16, 3x224x224, batch 64, 1000 classes)\n")
    print("| budget / lower bound | budget GiB | peak GiB | reserved GiB | plan |")
    print("|---|---|---|---|---|")
    base = rep("vgg16", (3, 224, 224), 64, 1000, "reuse,inplace")
    lb = base["lower_bound_bytes"]
    for f in (1.3, 1.2, 1.1, 1.05, 1.02):
        b = int(lb * f)
        r = rep("vgg16", (3, 224, 224), 64, 1000, f"auto,budget={b}")
        print(f"| {f:.2f} | {b / GIB:.3f} | {r['peak_allocated_bytes'] / GIB:.3f} | "
              f"{r['peak_reserved_bytes'] / GIB:.3f} | {r['notes'][0]} |")
    print()


def table_char_lstm() -> None:
    print("### char-lstm (2 layers, hidden 256, vocabulary 65), batch 32\n")
    print("| seq-len | spec | peak MiB | kept for backward MiB |")
    print("|---|---|---|---|")
    for t in (64, 1000):
        for s in ("reuse", "reuse,recompute=sqrt", "reuse,recompute=memory"):
            r = dry_run(char_rnn(65, 256, 256, 2, steps=t), 32, s, input_shape=(t,))
            print(f"| {t} | `{s}` | {r['peak_allocated_bytes'] / 2**20:.1f} | "
                  f"{r['kept_for_backward_bytes'] / 2**20:.1f} |")
    print()


def table_presets() -> None:
    print("### Peaks under the presets and under auto at two budgets (MiB; dry runs)\n")
    models = [
        ("lenet5", (1, 28, 28), 64, 10),
        ("vgg16", (3, 224, 224), 64, 1000),
        ("resnet50", (3, 224, 224), 64, 1000),
        ("resnet164", (3, 32, 32), 64, 10),
        ("char-lstm", (64,), 32, 65),
    ]
    specs = ["none", "reuse", "vdnn", "superneurons", "gist", "all"]
    print("| model | lower bound | " + " | ".join(f"`{s}`" for s in specs)
          + " | auto @1.3×LB | auto @1.1×LB |")
    print("|---" * (len(specs) + 4) + "|")
    for name, shape, batch, classes in models:
        cells = []
        first = None
        for s in specs:
            r = rep(name, shape, batch, classes, s)
            first = first or r
            cells.append(f"{r['peak_allocated_bytes'] / 2**20:,.0f}")
        lb = first["lower_bound_bytes"]
        for f in (1.3, 1.1):
            try:
                r = rep(name, shape, batch, classes, f"auto,budget={int(lb * f)}")
                split = f" (split {r['split']})" if r["split"] > 1 else ""
                cells.append(f"{r['peak_allocated_bytes'] / 2**20:,.0f}{split}")
            except MemoryError:
                cells.append("does not fit")
        print(f"| {name} {'x'.join(map(str, shape))} b{batch} | {lb / 2**20:,.0f} | "
              + " | ".join(cells) + " |")
    print()


TABLES = {"reuse": table_reuse, "vgg16": table_vgg16_specs, "auto": table_auto,
          "lstm": table_char_lstm, "presets": table_presets}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=sorted(TABLES))
    args = ap.parse_args()
    for name, fn in TABLES.items():
        if args.only in (None, name):
            fn()
