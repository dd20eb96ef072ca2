"""Quickstart: a small residual CNN, a dry run, and one training step with swapping."""

import numpy as np

import minidl
from minidl import layers as L
from minidl.net.optim import SGD

x = minidl.Input((1, 28, 28))
a = L.ReLU()(L.Conv2d(1, 16, 3, padding=1)(x))
b = L.ReLU()(L.Conv2d(16, 16, 3, padding=1)(a))
y = L.Add()(a, b)                                   # fan-out and a residual add
y = L.Linear(16 * 14 * 14, 10)(L.Flatten()(L.MaxPool2d(2)(y)))
net = minidl.Network(inputs=x, outputs=y)

print(minidl.dry_run(net, batch_size=64, memory="reuse,inplace")["peak_allocated_bytes"])

trainer = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9),
                         memory="reuse,inplace,swap=all", device_memory="64MiB")
xb = np.random.default_rng(0).standard_normal((64, 1, 28, 28)).astype(np.float32)
yb = np.arange(64) % 10
loss = trainer.step(xb, yb)          # afterwards every parameter's .grad holds its gradient
print(loss, trainer.memory_report()["breakdown"])
