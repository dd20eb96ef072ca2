"""Peaks and kept-for-backward bytes of the Part 10 gate list, one JSON line per cell:

    python benchmarks/gates/gate_plans.py > figures.txt   # run on two commits, then diff
"""
import json

from minidl import dry_run
from minidl.zoo.models import get_model
from minidl.zoo.rnn import char_rnn

SPECS = ["none", "reuse,inplace", "reuse,inplace,static", "reuse,inplace,swap=all",
         "reuse,inplace,recompute=cost", "reuse,inplace,recompute=sqrt", "reuse,inplace,binarize",
         "superneurons"]
CASES = [("vgg16", (3, 224, 224), 64, 1000), ("resnet50", (3, 224, 224), 32, 1000),
         ("alexnet", (3, 224, 224), 128, 1000), ("resnet56", (3, 32, 32), 128, 10)]
for m, shape, b, k in CASES:
    for spec in SPECS:
        r = dry_run(get_model(m, shape, k), b, spec, input_shape=shape)
        print(json.dumps([m, spec, r["peak_allocated_bytes"], r["peak_reserved_bytes"],
                          r.get("kept_for_backward_bytes")]))
RNN_SPECS = ["reuse", "reuse,recompute=sqrt", "reuse,recompute=memory", "reuse,bptt=4",
             "reuse,bptt=1"]
for spec in RNN_SPECS:
    r = dry_run(char_rnn(steps=1000), 32, spec, input_shape=(1000,))
    print(json.dumps(["char-lstm-1000", spec, r["peak_allocated_bytes"],
                      r["peak_reserved_bytes"], r.get("kept_for_backward_bytes")]))
