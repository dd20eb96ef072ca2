"""The labels a network's loss expects, by shape."""

from __future__ import annotations

from .graph import Network


def default_label_shape(net: Network, batch: tuple[int, ...]) -> tuple[int, ...]:
    """Integer class labels for the network's output: its shape without the class axis
    ((N,) for (N, K) logits, (N, T) for a sequence model's (N, T, V))."""
    unrolled = net.for_shapes([batch])
    shapes, _ = unrolled.infer([batch])
    return tuple(shapes[unrolled.output_values[0]][:-1])
