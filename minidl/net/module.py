"""``Module``: a network written as a class, PyTorch's way.

::

    class Net(minidl.Module):
        def __init__(self):
            super().__init__(input_shape=(1, 28, 28))
            self.conv1 = L.Conv2d(1, 16, 3, padding=1)
            self.block = [L.Conv2d(16, 16, 3, padding=1), L.ReLU()]
            self.fc = L.Linear(16 * 14 * 14, 10)

        def forward(self, x):
            ...

The class's ``forward`` is traced once, on :func:`~minidl.net.graph.Input` symbols, into the same
graph :class:`~minidl.net.graph.Network` builds from the functional API (a Module *is* a
Network: everything that takes one takes a Module), so a Module trains bit for bit like the
same network written with ``Input`` / ``Network``. Layers (and sub-Modules, and lists, tuples
or dicts of them, and :class:`~minidl.net.graph.Sequential` blocks) are attributes; each layer's
node, and so its parameters' ``state_dict`` names, come from the attribute path:
``conv1.weight``, ``block.0.weight``, ``encoder.attn.weight`` -- PyTorch's names for the same
module tree. Parameters are created once, when the graph is traced: at construction when
``input_shape`` is given, else when the network is first used (its per-sample shape then comes
from the first batch, as for a ``Sequential`` without one).

A parameter-free layer may be applied several times (``self.relu``: each further use is a
copy of it, named ``relu_2``, ...); one with parameters may not (minidl does not share
parameters between nodes of a Module). A layer with parameters must be an attribute: one made
inside ``forward`` would have no name and, in PyTorch, no place in the optimizer.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from typing import Any

from ..layers.base import Layer, Symbol
from .graph import Input, Network, Sequential

__all__ = ["Module", "ModuleError"]


class ModuleError(ValueError):
    """A Module whose ``forward`` cannot be traced into a network (the message is one line)."""


#: The Network attributes a Module builds when its graph is traced (first read of any of them
#: traces a Module constructed without an input shape).
_TRACED = frozenset({"nodes", "values", "inputs", "outputs", "output_values", "_params",
                     "dtype"})


class _ModuleType(type):
    """Traces a Module right after its ``__init__`` when it was given its input shape."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        config = obj.__dict__.get("_module_config")
        if config is None:
            raise ModuleError(f"{cls.__name__}.__init__ did not call super().__init__() "
                              "(minidl.Module's, before using the model)")
        if config["input_shape"] is not None:
            obj._trace()
        return obj


class Module(Network, metaclass=_ModuleType):
    """A network written as a class (see the module docstring): layers as attributes, and
    ``forward(self, x, ...)`` on symbolic tensors. ``input_shape`` is the per-sample shape of
    the input (a list of shapes for a forward taking several inputs), or ``None`` to take it
    from the first batch; ``input_dtype`` (``"int64"`` for token indices) likewise. ``name``
    defaults to the class's name; ``seed`` and ``dtype`` are the parameters' initialisation
    and dtype, as for :class:`~minidl.net.graph.Network`.

    Inside another Module's ``forward``, ``self.block(x)`` runs this Module's ``forward`` on
    the symbols (its layers join the outer network, named under the attribute ``block``).
    """

    def __init__(self, input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 name: str | None = None, seed: int = 0, dtype: str = "float32",
                 input_dtype: str | Sequence[str] | None = None) -> None:
        self.__dict__["_module_config"] = {
            "input_shape": None if input_shape is None else input_shape,
            "input_dtype": input_dtype, "seed": seed, "dtype": dtype}
        self.__dict__["_traced"] = False
        self.__dict__["_tracing"] = False
        self.name = name or type(self).__name__

    # ------------------------------------------------------------------ user side
    def forward(self, *inputs: Symbol) -> Symbol | tuple[Symbol, ...]:
        raise ModuleError(f"{type(self).__name__} defines no forward(self, x): write one "
                          "applying its layers to x and returning the output")

    def __call__(self, *inputs: Any) -> Any:
        """Inside another Module's ``forward``: this Module's ``forward`` on symbols."""
        for s in inputs:
            if not isinstance(s, Symbol):
                raise TypeError(
                    f"{type(self).__name__}(...) takes symbolic tensors (inside another "
                    f"Module's forward), got {type(s).__name__}: to run it on data use "
                    "minidl.Trainer(net).predict(x)")
        return self.forward(*inputs)

    def __getattr__(self, name: str) -> Any:
        # (only for names the instance and its class lack)
        state = self.__dict__
        if name in _TRACED and "_module_config" in state and not state["_traced"] \
                and not state["_tracing"]:
            self._trace()
            return getattr(self, name)
        if name.startswith("__") or "_module_config" not in state:
            raise AttributeError(name)
        where = " (read in forward)" if state["_tracing"] else ""
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}{where}: assign "
                             f"self.{name} in __init__ before it is used")

    def set_input_shape(self, shape: Sequence[int]) -> None:
        """The per-sample input shape of a Module constructed without one (before it is
        traced: the shape of ``minidl plan --input`` for a user's model)."""
        if self.__dict__["_traced"]:
            raise ModuleError(f"{self.name} is already traced for input "
                              f"{self.input_shapes[0]}")
        self._module_config["input_shape"] = tuple(int(s) for s in shape)

    @property
    def input_shape_given(self) -> Any:
        """The ``input_shape`` it was constructed with (``None``: from the first batch)."""
        return self._module_config["input_shape"]

    @property
    def traced(self) -> bool:
        """Whether ``forward`` has been traced into the network's graph."""
        return bool(self.__dict__.get("_traced"))

    # ------------------------------------------------------------------ tracing
    def _trace(self) -> None:
        """``forward`` on Input symbols, then the Network's graph and parameters."""
        config = self._module_config
        cls = type(self).__name__
        if type(self).forward is Module.forward:
            Module.forward(self)
        arity = _forward_arity(self)
        shapes = _per_input(config["input_shape"], arity, "input_shape", cls)
        dtypes = _per_input(config["input_dtype"], arity, "input_dtype", cls, scalar=str)
        names = ["input"] if arity == 1 else [f"input{k}" for k in range(arity)]
        inputs = [Input(shape, dtype=dtype or config["dtype"], name=n)
                  for shape, dtype, n in zip(shapes, dtypes, names)]
        paths, blocks = _attribute_paths(self)
        self.__dict__["_tracing"] = True
        try:
            out = self.forward(*inputs)
        finally:
            self.__dict__["_tracing"] = False
        outputs = [out] if isinstance(out, Symbol) else (
            list(out) if isinstance(out, (tuple, list)) else None)
        if not outputs or not all(isinstance(s, Symbol) for s in outputs):
            raise ModuleError(f"{cls}.forward returned {_kind(out)}, not the symbolic output of "
                              "a layer: return what the last layer gave (or a tuple of them)")
        if any(s in inputs for s in outputs):
            raise ModuleError(f"{cls}.forward returns its input unchanged: apply a layer")
        _name_layers(cls, inputs, outputs, paths)
        self.inputs, self.outputs = inputs, outputs
        self._build_graph()
        self._create_parameters(config["seed"], config["dtype"])
        self.__dict__["_traced"] = True
        _share_with_blocks(self, blocks)


def _forward_arity(module: Module) -> int:
    """How many tensors ``forward`` takes (its positional parameters after ``self``)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return 1
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        raise ModuleError(f"{type(module).__name__}.forward takes *args: name its inputs "
                          "(forward(self, x) or forward(self, x, mask))")
    n = sum(1 for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD)
            and p.default is inspect.Parameter.empty)
    if n == 0:
        raise ModuleError(f"{type(module).__name__}.forward takes no input: write "
                          "forward(self, x)")
    return n


def _per_input(value: Any, arity: int, what: str, cls: str, scalar: type = int) -> list[Any]:
    """``value`` (one for a single input, else one per input) as a list of ``arity``."""
    if value is None:
        return [None] * arity
    if arity == 1:
        if scalar is int:
            if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
                if len(value) != 1:
                    raise ModuleError(f"{cls}: {what} gives {len(value)} shapes; forward "
                                      "takes 1 input")
                value = value[0]
            return [tuple(int(s) for s in value)]
        return [value]
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or len(value) != arity \
            or (scalar is int and not all(v is None or isinstance(v, (list, tuple))
                                          for v in value)):
        raise ModuleError(f"{cls}: forward takes {arity} inputs, so {what} must list one per "
                          f"input, got {value!r}")
    return [None if v is None else (tuple(int(s) for s in v) if scalar is int else v)
            for v in value]


def _kind(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _attribute_paths(module: Module) -> tuple[dict[int, str], list[tuple[str, Sequential]]]:
    """Each layer reachable through the attributes (sub-Modules, lists, tuples, dicts and
    Sequential blocks included) -> its dotted path, in assignment order; and the Sequential
    blocks with their paths."""
    paths: dict[int, str] = {}
    blocks: list[tuple[str, Sequential]] = []
    seen: set[int] = set()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, Layer):
            paths.setdefault(id(value), path)
        elif isinstance(value, Sequential):
            if id(value) not in seen:
                seen.add(id(value))
                blocks.append((path, value))
                for k, layer in enumerate(value.layers):
                    walk(layer, f"{path}.{k}")
        elif isinstance(value, Module):
            if id(value) not in seen:
                seen.add(id(value))
                for k, v in vars(value).items():
                    if not k.startswith("_"):
                        walk(v, f"{path}.{k}" if path else k)
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                walk(v, f"{path}.{k}")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}")

    walk(module, "")
    return paths, blocks


def _name_layers(cls: str, inputs: list[Symbol], outputs: list[Symbol],
                 paths: dict[int, str]) -> None:
    """Every layer between ``inputs`` and ``outputs`` named for the graph: its attribute path;
    a parameter-free layer applied again is replaced there by a copy (``relu_2``, ...); a layer
    made inside forward gets its type and a count. Refuses a layer with parameters that is no
    attribute or is applied twice."""
    used = set(paths.values())
    counters: dict[str, int] = {}
    # one entry per application (a call's outputs share its inputs tuple), in graph order
    applications: dict[tuple[int, int], list[Symbol]] = {}
    for s in _post_order(outputs, {id(s) for s in inputs}):
        applications.setdefault((id(s.layer), id(s.inputs)), []).append(s)
    uses: dict[int, int] = {}
    for symbols in applications.values():
        layer = symbols[0].layer
        uses[id(layer)] = n = uses.get(id(layer), 0) + 1
        path = paths.get(id(layer))
        has_params = bool(layer.param_specs())
        kind = type(layer).__name__
        if path is None and has_params:
            raise ModuleError(f"{cls}.forward applies a {kind} ({layer.describe()}) that is "
                              "no attribute of the model: its parameters would have no name; "
                              f"create it in __init__ (self.name = {kind}(...))")
        if n == 1:
            layer.name = path if path is not None else _unique(kind.lower(), counters, used)
            used.add(layer.name)
            continue
        if has_params:
            raise ModuleError(f"{cls}.forward applies self.{path} ({layer.describe()}) more "
                              "than once: a layer's parameters belong to one use; create one "
                              "layer per use")
        clone = copy.copy(layer)
        clone.name = _unique(f"{layer.name}_", counters, used, start=n)
        used.add(clone.name)
        for s in symbols:
            s.layer = clone


def _unique(base: str, counters: dict[str, int], used: set[str], start: int = 1) -> str:
    k = max(counters.get(base, start - 1) + 1, start)
    while f"{base}{k}" in used:
        k += 1
    counters[base] = k
    return f"{base}{k}"


def _post_order(outputs: list[Symbol], stop: set[int]) -> list[Symbol]:
    """The symbols ``outputs`` depend on (down to ``stop``), inputs before readers, in the
    order the graph builder visits them."""
    order: list[Symbol] = []
    done: set[int] = set(stop)
    for root in outputs:
        stack: list[tuple[Symbol, bool]] = [(root, False)]
        while stack:
            s, expanded = stack.pop()
            if id(s) in done:
                continue
            if s.layer is None:
                raise ModuleError(f"forward reads {s!r}, which is not one of its inputs")
            if expanded:
                done.add(id(s))
                order.append(s)
                continue
            stack.append((s, True))
            stack.extend((p, False) for p in reversed(s.inputs) if id(p) not in done)
    return order


def _share_with_blocks(module: Module, blocks: list[tuple[str, Sequential]]) -> None:
    """A Sequential block used as an attribute keeps no parameters of its own: it shares the
    Module's (the same arrays, named as in the Module)."""
    by_layer = {id(node.layer): module._params[node.name] for node in module.nodes}
    for _, block in blocks:
        for node in block.nodes:
            shared = by_layer.get(id(node.layer))
            if shared is not None:
                block._params[node.name] = shared
