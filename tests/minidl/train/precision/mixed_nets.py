"""Small networks the mixed-precision tests share."""

from __future__ import annotations

import minidl
from minidl.net.graph import Input, Network


def branches() -> Network:
    """Two convolution branches joined by Concat (an Inception / DenseNet join), max-pooled,
    then a classifier: 3x8x8 inputs, 10 classes."""
    x = Input((3, 8, 8))
    a = minidl.layers.ReLU()(minidl.layers.Conv2d(3, 4, 3, padding=1)(x))
    b = minidl.layers.ReLU()(minidl.layers.Conv2d(3, 2, 1)(x))
    h = minidl.layers.MaxPool2d(2)(minidl.layers.Concat()(a, b))
    return Network(x, minidl.layers.Linear(96, 10)(minidl.layers.Flatten()(h)), seed=5)
