"""What a GPU training step costs the host, counted on the strict CUDA test device (no GPU
needed): host synchronisations and launches per step that does not wait, launches per layer
call (the most over the layer's calls; a fused recurrent stack's per time step and layer), the
optimizer's launches, and the scratch block CuPy's own temporaries need.

    python benchmarks/gpu/strict_counts.py [--models smallcnn,resnet20,char-lstm,gpt-char]
"""

from __future__ import annotations

import argparse
from collections import Counter

import minidl
from minidl.compile.executor import Executor
from minidl.memory.testing.strict_device import StrictCudaDevice
from minidl.net.optim import SGD, AdamW
from minidl.tools.bench import synthetic_batch
from minidl.zoo.models import get_model

CASES = {"smallcnn": ((1, 28, 28), 32), "resnet20": ((3, 32, 32), 32),
         "vgg11": ((3, 32, 32), 16), "char-lstm": ((64,), 16), "gpt-char": ((64,), 4)}


def count(model: str, spec: str) -> dict:
    shape, batch = CASES[model]
    net = get_model(model, input_shape=shape)
    x, y = synthetic_batch(net, shape, batch, 0)
    dev = StrictCudaDevice("1GiB")
    opt = AdamW(net.parameters(), lr=1e-3) if model.startswith("gpt") else \
        SGD(net.parameters(), lr=0.01, momentum=0.9)
    tr = minidl.Trainer(net, opt, memory=spec, device=dev, device_memory="1GiB")
    tr.step(x, y)
    tr.step(x, y)
    per_layer: Counter = Counter()
    originals = {name: getattr(Executor, name) for name in ("_forward", "_backward")}

    def counting(run):
        def counted(self, st, rt, *args):
            before = dev.launches
            run(self, st, rt, *args)
            layer = self.layers[st.node]
            units = rt.program.tensors[st.forward.inputs[0]].shape[1] * layer.num_layers \
                if hasattr(layer, "num_layers") else 1
            key = (type(layer).__name__, st.phase)
            per_layer[key] = max(per_layer[key], (dev.launches - before) / units)
        return counted

    for name, run in originals.items():
        setattr(Executor, name, counting(run))
    try:
        syncs, launches = dev.host_syncs, dev.launches
        tr.step(x, y, wait=False)
        row = {"syncs": dev.host_syncs - syncs, "launches": dev.launches - launches}
    finally:
        for name, run in originals.items():
            setattr(Executor, name, run)
    before = dev.launches
    tr.optimizer.step()
    row["optimizer"] = dev.launches - before
    row["scratch"] = tr.engine.scratch.size if tr.engine.scratch is not None else 0
    row["per_layer"] = dict(per_layer)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smallcnn,resnet20,char-lstm,gpt-char")
    p.add_argument("--memory", default="reuse,inplace")
    args = p.parse_args()
    for model in args.models.split(","):
        r = count(model, args.memory)
        shape, batch = CASES[model]
        layers = ", ".join(f"{k[0]} {k[1][:3]} {v:.0f}" for k, v in sorted(
            r["per_layer"].items(), key=lambda kv: -kv[1]))
        print(f"{model} b{batch} {'x'.join(map(str, shape))} {args.memory}: host syncs per step "
              f"{r['syncs']}, launches per step {r['launches']}, optimizer {r['optimizer']}, "
              f"scratch {r['scratch']:,} B; per layer call: {layers}")


if __name__ == "__main__":
    main()
