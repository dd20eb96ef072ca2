"""Hypothesis strategy over small random conv networks, shared by the memory-strategy tests.

Imported as ``tests.minidl.random_nets`` (pytest's ``--import-mode=importlib`` registers the
``tests`` folders as packages).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

import minidl
from minidl import layers as L

OPS = ["conv", "relu", "tanh", "leaky", "bn", "dropout", "add", "concat", "pool", "sigmoid"]


@st.composite
def random_networks(draw: Any, batchnorm: bool = False) -> tuple:
    """``((channels, size), (input symbol, output symbol, seed))`` of a random network of
    conv / activation / BatchNorm / dropout / add / concat / pool ops on a ``(channels, size,
    size)`` input, with fan-out, ending in global average pooling and a 5-way linear layer.
    ``batchnorm=True``: a BatchNorm is appended after the random ops when none was drawn on
    the path to the output (the draws are the same, so shrinking works as without)."""
    c0 = draw(st.integers(1, 3))
    hw = draw(st.sampled_from([4, 6]))
    x = minidl.Input((c0, hw, hw))
    values = [(x, c0, hw)]
    after_bn = [False]  # per value: a BatchNorm is upstream of it
    n_ops = draw(st.integers(2, 9))
    for _ in range(n_ops):
        op = draw(st.sampled_from(OPS))
        i = draw(st.integers(0, len(values) - 1))
        v, c, s = values[i]
        if op == "conv":
            co = draw(st.integers(1, 4))
            k = draw(st.sampled_from([1, 3]))
            values.append((L.Conv2d(c, co, k, padding=k // 2)(v), co, s))
        elif op == "relu":
            values.append((L.ReLU()(v), c, s))
        elif op == "tanh":
            values.append((L.Tanh()(v), c, s))
        elif op == "sigmoid":
            values.append((L.Sigmoid()(v), c, s))
        elif op == "leaky":
            values.append((L.LeakyReLU(0.1)(v), c, s))
        elif op == "bn":
            values.append((L.BatchNorm2d(c)(v), c, s))
        elif op == "dropout":
            values.append((L.Dropout(0.3)(v), c, s))
        elif op == "pool" and s >= 2:
            values.append((L.MaxPool2d(2)(v), c, s // 2))
        elif op in ("add", "concat"):
            same = [n for n, w in enumerate(values)
                    if w[2] == s and (op == "concat" or w[1] == c)]
            j = same[draw(st.integers(0, len(same) - 1))]
            w = values[j]
            if op == "add":
                values.append((L.Add()(v, w[0]), c, s))
            else:
                values.append((L.Concat(axis=1)(v, w[0]), c + w[1], s))
            after_bn.append(after_bn[i] or after_bn[j])
        if len(after_bn) < len(values):
            after_bn.append(op == "bn" or after_bn[i])
    if batchnorm and not after_bn[-1]:
        v, c, s = values[-1]
        values.append((L.BatchNorm2d(c)(v), c, s))
    # the output reads the last value and, to create fan-out, sometimes an earlier one too
    v, c, s = values[-1]
    k = draw(st.integers(0, len(values) - 1))
    if k != len(values) - 1 and values[k][2] == s:
        v = L.Concat(axis=1)(v, values[k][0])
        c = c + values[k][1]
    g = L.GlobalAvgPool2d()(v)
    out = L.Linear(c, 5)(g)
    seed = draw(st.integers(0, 1000))
    return (c0, hw), (x, out, seed)
