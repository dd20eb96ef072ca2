"""``Checkpoint(block)``: force one memory choice on every layer of a block of the functional
graph (``torch.utils.checkpoint.checkpoint(fn, x)``, ``jax.checkpoint``).

A block is any callable from symbolic tensors to symbolic tensors: a layer, a list of layers
applied in order, or a function building a sub-graph. ``Checkpoint(block)(x)`` builds it on
``x`` and marks every layer between the block's inputs and its outputs with ``memory``
(``"recompute"`` by default; ``"swap"`` or ``"keep"``). The mark is plain data on the layer
(:attr:`~minidl.layers.base.Layer.memory_choice`); lowering copies it onto the layer's steps,
where every memory planner reads it. A layer already marked (an inner block, or
``layer(x, memory=...)``) keeps its own choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import Layer, Symbol

Block = Callable[..., "Symbol | Sequence[Symbol]"] | Sequence[Layer]


class Checkpoint:
    """A block whose feature maps the planners must ``recompute`` (default), ``swap`` or
    ``keep``: ``y = Checkpoint([conv, bn, relu])(x)`` or ``Checkpoint(fn, memory="swap")(x)``.
    The block must read nothing from the graph but the symbols it is called on."""

    def __init__(self, block: Block, memory: str = "recompute") -> None:
        if not callable(block) and not (isinstance(block, Sequence) and block
                                        and all(isinstance(x, Layer) for x in block)):
            raise TypeError("Checkpoint takes a layer, a non-empty list of layers or a "
                            f"callable on symbols, got {type(block).__name__}")
        self.block = block
        self.memory = memory

    def __call__(self, *inputs: Symbol) -> Symbol | tuple[Symbol, ...]:
        if callable(self.block):
            out = self.block(*inputs)
        else:
            if len(inputs) != 1:
                raise TypeError(f"a list of layers takes one input, got {len(inputs)}")
            out = inputs[0]
            for layer in self.block:
                out = layer(out)
        outs = (out,) if isinstance(out, Symbol) else tuple(out)
        if not outs or not all(isinstance(s, Symbol) for s in outs):
            raise TypeError("a Checkpoint block must return symbolic tensors")
        for layer in block_layers(inputs, outs):
            if not layer.memory_choice:
                layer.memory_choice = self.memory
        return out


def block_layers(inputs: Sequence[Symbol], outputs: Sequence[Symbol]) -> list[Layer]:
    """The layers between ``inputs`` and ``outputs`` (walking back from the outputs, stopping
    at the inputs). Raises ``ValueError`` when the block reads a graph input it was not
    called on."""
    stop = {id(s) for s in inputs}
    seen: set[int] = set()
    layers: list[Layer] = []
    stack = [s for s in outputs if id(s) not in stop]
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if s.layer is None:
            raise ValueError(f"the block reads {s!r}, which is not among the symbols it was "
                             "called on: pass every tensor the block reads as an input")
        if all(layer is not s.layer for layer in layers):
            layers.append(s.layer)
        stack.extend(p for p in s.inputs if id(p) not in stop)
    return layers
