"""CuPy's own temporaries per training step, measured on the strict CUDA test device.

A GPU run reserves a scratch block of this size next to the parameters (measured at its first
step); the dry run for the cuda kind gives every other byte. One line per model and spec:

    python benchmarks/measured/strict_scratch.py
"""
import numpy as np

import minidl
from minidl.memory.testing.strict_device import StrictCudaDevice
from minidl.net.optim import SGD
from minidl.zoo.models import resnet, smallcnn, vgg

CASES = [("smallcnn", smallcnn, (1, 28, 28), 64),
         ("resnet20", lambda: resnet(20, (3, 32, 32), 10), (3, 32, 32), 32),
         ("vgg11", lambda: vgg(11, input_shape=(3, 32, 32), num_classes=10), (3, 32, 32), 16)]
MIB = 1 << 20
rng = np.random.default_rng(0)
for name, make, shape, batch in CASES:
    for spec in ["none", "reuse,inplace", "vdnn"]:
        x = rng.standard_normal((batch, *shape)).astype(np.float32)
        y = rng.integers(0, 10, batch)
        net = make()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                            device=StrictCudaDevice("1GiB"), device_memory="1GiB")
        tr.step(x, y)
        scratch = tr.engine.scratch.size if tr.engine.scratch is not None else 0
        tr.pool.reset_peak_stats()
        tr.step(x, y)
        real = tr.pool.stats()["allocated_bytes.peak"]
        cpu = minidl.dry_run(make(), batch, spec)["peak_allocated_bytes"]
        gpu = minidl.dry_run(make(), batch, spec, device_kind="cuda",
                             scratch_bytes=scratch)["peak_allocated_bytes"]
        print(f"{name} b{batch} {spec}: CuPy scratch {scratch / MIB:.2f} MiB; peak: cpu plan "
              f"{cpu / MIB:.1f} MiB, cuda plan {gpu / MIB:.1f} MiB, strict-device run "
              f"{real / MIB:.1f} MiB ({'equal' if real == gpu else 'DIFFERENT'})")
