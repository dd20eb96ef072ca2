"""Network definition: ``Input``, the functional ``Network`` and ``Sequential``.

A network is a DAG of layer nodes over values (its inputs and the layers' outputs). Shapes are
inferred for a given batch input shape before any compute (:meth:`Network.infer`); parameters
are created once, at construction, from each layer's declared specs, with PyTorch's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layers.base import Layer, ShapeError, Symbol
from ..memory.ir.units import format_size
from ..memory.passes.block_choices import BLOCK_CHOICES
from ..memory.runtime.transfer import copy_into, to_host
from .deferred_init import DeferredInitialiser, deferring
from .param_memory import check_parameter_memory
from .parameter import Parameter, new_parameter

Shape = tuple[int, ...]


def Input(shape: Sequence[int] | None, dtype: str = "float32", name: str | None = None) -> Symbol:
    """A network input of per-sample ``shape`` (no batch dimension), e.g. ``Input((1, 28, 28))``.

    Integer inputs (token indices for an Embedding) use ``dtype="int64"``.
    """
    if shape is not None:
        shape = tuple(int(s) for s in shape)
        if any(s <= 0 for s in shape):
            raise ValueError(f"input shape must be positive, got {shape}")
    return Symbol(None, (), 0, shape=shape, dtype=np.dtype(dtype), name=name)


@dataclass
class Node:
    """One layer application: the values it reads and writes (indices into ``Network.values``)."""

    index: int
    name: str
    layer: Layer
    in_values: list[int]
    out_values: list[int]
    #: The user's memory choice for its feature maps (``layer(x, memory=...)``, a
    #: ``Checkpoint`` block; one of :data:`~minidl.memory.passes.block_choices.BLOCK_CHOICES`) or
    #: "".
    memory: str = ""


def listed_names(names: list[str], limit: int = 4) -> str:
    """``names`` for a one-line message: the first ``limit`` and how many in all (a wrong
    model's checkpoint misses hundreds)."""
    if not names:
        return "none"
    head = ", ".join(names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")


@dataclass
class Value:
    name: str
    producer: int  # node index, or -1 for a network input
    output_index: int = 0


class _GraphBuilder:
    """The values and nodes of a network read from its symbols: the inputs' values first, then
    each layer's node (named once: ``names[i]``, the layer's name, or its type and a count)
    in post-order from the outputs."""

    def __init__(self, inputs: list[Symbol], names: Sequence[str] | None) -> None:
        self.names = names
        self.sym_value: dict[int, int] = {}
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        for k, s in enumerate(inputs):
            self.sym_value[id(s)] = len(self.values)
            self.values.append(Value(s.name or f"input{k if len(inputs) > 1 else ''}", -1))
        self.layer_node: dict[int, Node] = {}
        self.counters: dict[str, int] = {}
        self.used_names: set[str] = set()

    def node_name(self, layer: Layer, idx: int) -> str:
        """The name of node ``idx`` (``ValueError`` for a name already taken)."""
        if self.names is not None:
            name = self.names[idx]
        elif layer.name:
            name = layer.name
        else:
            base = type(layer).__name__.lower()
            self.counters[base] = self.counters.get(base, 0) + 1
            name = f"{base}{self.counters[base]}"
        if name in self.used_names:
            raise ValueError(f"two layers are named {name!r}")
        self.used_names.add(name)
        return name

    def new_node(self, layer: Layer, in_values: list[int]) -> Node:
        """The node of ``layer`` reading ``in_values``, with its output values (the layer
        takes the node's name)."""
        idx = len(self.nodes)
        name = self.node_name(layer, idx)
        layer.name = name
        outs = []
        for j in range(layer.num_outputs):
            outs.append(len(self.values))
            suffix = "" if layer.num_outputs == 1 else f".{j}"
            self.values.append(Value(f"{name}{suffix}", idx, j))
        if layer.memory_choice and layer.memory_choice not in BLOCK_CHOICES:
            raise ValueError(
                f"layer {name}: memory={layer.memory_choice!r} is not a memory choice; "
                f"valid: {', '.join(BLOCK_CHOICES)}")
        node = Node(idx, name, layer, in_values, outs, layer.memory_choice)
        self.nodes.append(node)
        self.layer_node[id(layer)] = node
        return node

    def add_node(self, s: Symbol) -> None:
        """Create (or find) the node of symbol ``s`` whose inputs all have values."""
        layer = s.layer
        in_values = [self.sym_value[id(p)] for p in s.inputs]
        node = self.layer_node.get(id(layer))
        if node is None:
            node = self.new_node(layer, in_values)
        elif in_values != node.in_values:
            raise ValueError(
                f"layer {node.name} is applied twice; shared layers are not supported "
                "(create a second layer)"
            )
        self.sym_value[id(s)] = node.out_values[s.index]

    def visit(self, root: Symbol) -> int:
        """Post-order over the symbols ``root`` depends on, iteratively (deep ResNets); the
        value of ``root``."""
        sym_value = self.sym_value
        stack: list[tuple[Symbol, bool]] = [(root, False)]
        on_path: set[int] = set()
        while stack:
            s, expanded = stack.pop()
            if id(s) in sym_value:
                continue
            if s.layer is None:
                raise ValueError(
                    f"the graph reads input {s!r} that is not among the Network's inputs"
                )
            if expanded:
                on_path.discard(id(s))
                self.add_node(s)
                continue
            if id(s) in on_path:
                raise ValueError(f"cycle through layer {s.layer!r}")
            on_path.add(id(s))
            stack.append((s, True))
            for p in reversed(s.inputs):
                if id(p) not in sym_value:
                    stack.append((p, False))
        return sym_value[id(root)]


class Network:
    """A functional graph from ``inputs`` to ``outputs`` (one symbol or a list of them).

    ``seed`` makes parameter initialisation reproducible; ``dtype`` is the parameters' dtype.
    """

    def __init__(
        self,
        inputs: Symbol | Sequence[Symbol],
        outputs: Symbol | Sequence[Symbol],
        name: str = "network",
        seed: int = 0,
        dtype: str = "float32",
    ) -> None:
        self.name = name
        self.inputs = [inputs] if isinstance(inputs, Symbol) else list(inputs)
        self.outputs = [outputs] if isinstance(outputs, Symbol) else list(outputs)
        for s in self.inputs:
            if s.layer is not None:
                raise ValueError("Network inputs must come from minidl.Input(...)")
        self._build_graph()
        self._create_parameters(seed, dtype)

    # ------------------------------------------------------------------ structure
    def _build_graph(self, names: Sequence[str] | None = None) -> None:
        builder = _GraphBuilder(self.inputs, names)
        self.values: list[Value] = builder.values
        self.nodes: list[Node] = builder.nodes
        self.output_values = [builder.visit(s) for s in self.outputs]

    def _create_parameters(self, seed: int, dtype: str = "float32") -> None:
        rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        # (deferred: drawn, and counted, when first read)
        initialiser = DeferredInitialiser(self.name) if deferring() else None
        if initialiser is None:
            # (counted from the shapes first: a network too large for the host, refused in a line)
            check_parameter_memory(self.name, [
                spec for node in self.nodes if getattr(node.layer, "bound_params", None) is None
                for spec in node.layer.param_specs().values()], self.dtype)
        self._params: dict[str, dict[str, Parameter]] = {}
        for node in self.nodes:
            specs = node.layer.param_specs()
            bound = getattr(node.layer, "bound_params", None)
            if bound is not None:
                # parameters shared with other nodes (an unrolled RNN's steps): same objects
                missing = sorted(set(specs) - set(bound))
                if missing:
                    raise ValueError(f"layer {node.name}: no bound parameter for {missing}")
                for pname, spec in specs.items():
                    if bound[pname].shape != tuple(spec.shape):
                        raise ValueError(
                            f"layer {node.name}: bound parameter {bound[pname].name} has shape "
                            f"{bound[pname].shape}, the layer declares {tuple(spec.shape)}")
                self._params[node.name] = {k: bound[k] for k in specs}
                continue
            self._params[node.name] = {
                pname: new_parameter(
                    f"{node.name}.{pname}", spec.shape, spec.dtype or self.dtype,
                    lambda spec=spec: spec.initial_value(rng, self.dtype),
                    trainable=spec.trainable, initialiser=initialiser,
                )
                for pname, spec in specs.items()
            }

    # ------------------------------------------------------------------ parameters
    def layer_params(self, node_name: str) -> dict[str, Parameter]:
        return self._params[node_name]

    def named_parameters(self, include_buffers: bool = False) -> Iterator[tuple[str, Parameter]]:
        """(name, parameter) pairs in layer order, PyTorch names (``conv1.weight``); a
        parameter shared by several layers appears once."""
        seen: set[int] = set()
        for node in self.nodes:
            for p in self._params[node.name].values():
                if (p.trainable or include_buffers) and id(p) not in seen:
                    seen.add(id(p))
                    yield p.name, p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def buffers(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters(True) if not p.trainable]

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.parameters())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every parameter and buffer as NumPy arrays."""
        return {n: to_host(p.data) for n, p in self.named_parameters(True)}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Copy arrays (NumPy arrays, or anything ``np.asarray`` takes such as CPU torch
        tensors) into the parameters and buffers in place. Every name and shape is checked
        before anything is copied, so a failed load leaves the network unchanged."""
        own = dict(self.named_parameters(True))
        if strict:
            missing = sorted(set(own) - set(state))
            unexpected = sorted(set(state) - set(own))
            if missing or unexpected:
                raise KeyError(f"state_dict mismatch: missing {listed_names(missing)}, "
                               f"unexpected {listed_names(unexpected)}")
        values = {name: np.asarray(value) for name, value in state.items() if name in own}
        for name, value in values.items():
            if tuple(value.shape) != own[name].shape:
                raise ValueError(f"{name}: expected shape {own[name].shape}, "
                                 f"got {tuple(value.shape)}")
        for name, value in values.items():
            copy_into(own[name].data, value.astype(own[name].dtype, copy=False))

    # ------------------------------------------------------------------ shapes
    @property
    def input_shapes(self) -> list[Shape | None]:
        return [s.shape for s in self.inputs]

    def infer(self, batch_shapes: Sequence[Shape]) -> tuple[list[Shape], list[np.dtype]]:
        """Shapes and dtypes of every value for full (batch-first) input shapes.

        Raises :class:`ShapeError` naming the input or layer and both shapes on a mismatch.
        """
        if len(batch_shapes) != len(self.inputs):
            raise ShapeError(
                f"{self.name} takes {len(self.inputs)} input(s), got {len(batch_shapes)}")
        shapes: list[Shape | None] = [None] * len(self.values)
        dtypes: list[np.dtype | None] = [None] * len(self.values)
        for k, (sym, shp) in enumerate(zip(self.inputs, batch_shapes)):
            shp = tuple(int(d) for d in shp)
            if sym.shape is not None and tuple(shp[1:]) != tuple(sym.shape):
                raise ShapeError(
                    f"input {self.values[k].name!r} of {self.name} expects per-sample shape "
                    f"{tuple(sym.shape)}, got {tuple(shp[1:])} (batch shape {shp})"
                )
            if len(shp) < 1 or shp[0] <= 0:
                raise ShapeError(f"input {self.values[k].name!r}: empty batch (shape {shp})")
            shapes[k] = shp
            dtypes[k] = np.dtype(sym.dtype)
        for node in self.nodes:
            in_shapes = [shapes[v] for v in node.in_values]
            try:
                outs = node.layer.output_shapes(in_shapes)
            except ShapeError:
                raise
            except (ValueError, IndexError, TypeError) as e:
                raise ShapeError(f"layer {node.name} ({node.layer.describe()}): {e}") from e
            odt = node.layer.output_dtypes([dtypes[v] for v in node.in_values])
            for v, s, d in zip(node.out_values, outs, odt):
                shapes[v] = tuple(int(x) for x in s)
                dtypes[v] = np.dtype(d)
        return shapes, dtypes  # type: ignore[return-value]

    def for_shapes(self, batch_shapes: Sequence[Shape]) -> Network:
        """The network to run for these input shapes: itself, except for models built per
        sequence length (:class:`~minidl.zoo.rnn.SequenceModel`)."""
        return self

    def summary(self, batch_shapes: Sequence[Shape] | None = None,
                memory: dict[str, dict[str, int]] | None = None,
                memory_note: str = "") -> str:
        """One line per layer: name, layer, output shape (with ``batch_shapes``), parameter
        count, in columns as wide as their longest entry. ``memory`` (per layer name:
        ``output``, ``kept`` for backward and ``workspace`` bytes, as
        :func:`minidl.analysis.summary.layer_memory` gives for a batch and memory spec; or call
        :func:`minidl.analysis.summary.summary`) adds those columns; ``memory_note`` says for
        what."""
        shapes = None
        if batch_shapes is not None:
            shapes, _ = self.infer(batch_shapes)
        head = ["layer", "type", "output", "params"]
        mem_keys = ("output", "kept", "workspace")
        if memory is not None:
            head += ["output bytes", "kept for bwd", "workspace"]
        rows = []
        for node in self.nodes:
            params = [p for p in self._params[node.name].values()
                      if getattr(node.layer, "bound_params", None) is None]
            n = sum(int(np.prod(p.shape)) for p in params if p.trainable)
            out = str(shapes[node.out_values[0]]) if shapes else ""
            row = [node.name, node.layer.describe(), out, f"{n:,}"]
            if memory is not None:
                m = memory.get(node.name, {})
                row += [format_size(m[k]) if m.get(k) else "-" for k in mem_keys]
            rows.append(row)
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = set(range(3, len(head)))  # numbers right-aligned

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        lines = [line(head), *[line(r) for r in rows]]
        lines.append(f"total trainable parameters: {self.num_parameters():,}")
        if memory is not None:
            total = {k: sum(m.get(k, 0) for m in memory.values()) for k in mem_keys[:2]}
            ws = max((m.get("workspace", 0) for m in memory.values()), default=0)
            lines.append(f"memory{f' ({memory_note})' if memory_note else ''}: outputs "
                         f"{format_size(total['output'])}, kept for backward "
                         f"{format_size(total['kept'])}, largest workspace {format_size(ws)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self.nodes)} layers)"


class Sequential(Network):
    """A chain of layers. Layers are named ``"0"``, ``"1"``, ... as in PyTorch's Sequential, so
    ``state_dict`` keys match ``torch.nn.Sequential``'s. ``input_shape`` (per sample) may be
    given now or inferred from the first batch."""

    def __init__(
        self,
        layers: Iterable[Layer],
        input_shape: Sequence[int] | None = None,
        name: str = "sequential",
        seed: int = 0,
        dtype: str = "float32",
        input_dtype: str | None = None,
    ) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("Sequential needs at least one layer")
        x = Input(input_shape, dtype=input_dtype or dtype, name="input")
        y = x
        for layer in self.layers:
            if not isinstance(layer, Layer):
                raise TypeError(f"Sequential takes layers, got {type(layer).__name__}")
            y = layer(y)
        self.name = name
        self.inputs = [x]
        self.outputs = [y]
        self._build_graph(names=[str(i) for i in range(len(self.layers))])
        self._create_parameters(seed, dtype)

    def __call__(self, x: Symbol) -> Symbol:
        """Its layers applied in order to the symbol ``x``: a block inside a
        :class:`~minidl.net.module.Module`'s ``forward`` (the Module names the layers
        ``block.0``, ... and holds their parameters)."""
        if not isinstance(x, Symbol):
            raise TypeError(f"{self.name}(x) takes a symbolic tensor (inside a Module's forward), "
                            f"got {type(x).__name__}: to run it on data use "
                            "minidl.Trainer(net).predict(x)")
        for layer in self.layers:
            x = layer(x)
        return x
