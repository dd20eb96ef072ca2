"""Recurrent networks and the character-level language models, in two forms.

* **fused** (default): one :class:`~minidl.layers.LSTM` / :class:`~minidl.layers.GRU` node for
  the whole layer stack, looping over time inside (cuDNN's form, the fast one). Memory over
  time is the layer's BPTT *schedule*, a per-step option of the plan
  (:mod:`minidl.memory.options.bptt_options`), chosen from the memory spec: everything kept by
  default; ``recompute=sqrt`` keeps every ⌈√U⌉-th of the U time units' states (Chen et
  al.); ``bptt=N`` or any other ``recompute=`` value keeps at most N (default ⌈√U⌉) states
  where Gruslys et al.'s dynamic programme says, at the fewest recomputed units.
* **unrolled** (``char-lstm-unrolled``): for T steps, one input-projection node (all steps'
  ``x W_ih^T + b_ih`` in one GEMM) and T cell nodes sharing ``weight_hh`` / ``bias_hh``, so
  that the generic liveness, swapping, recomputation and compression passes act per step.

A :class:`SequenceModel` builds the network for each sequence length it meets,
cached, every build sharing the same parameter objects, with PyTorch's names
(``lstm.weight_ih_l0``, ...) and layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import layers as L
from ..layers.base import Layer, Symbol
from ..net.builder import named
from ..net.deferred_init import DeferredInitialiser, deferring
from ..net.graph import Input, Network
from ..net.parameter import Parameter, new_parameter

#: Time steps per unit of the fused layers' loops and schedules: the weight-gradient GEMMs
#: then run on N*16 rows (512 for batch 32, ~95% of OpenBLAS's large-GEMM rate here).
UNIT_STEPS = 16


class ParameterStore:
    """Creates each named parameter once (from the first layer that declares it) and binds the
    same objects into every layer that uses it."""

    def __init__(self, seed: int = 0, dtype: str = "float32") -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = np.dtype(dtype)
        self.params: dict[str, Parameter] = {}
        # (under deferred_parameters(): values drawn, in this order, when one is first read)
        self.initialiser = DeferredInitialiser("ParameterStore") if deferring() else None

    def bind(self, layer: Layer, names: dict[str, str], order: Sequence[str] = ()) -> Layer:
        """Give ``layer`` the parameters ``names`` maps its local names to (created on first
        use from the layer's specs, the local names in ``order`` first)."""
        specs = layer.param_specs()
        specs = {k: specs[k] for k in [*order, *(k for k in specs if k not in order)]}
        bound = {}
        for local, spec in specs.items():
            full = names[local]
            if full not in self.params:
                self.params[full] = new_parameter(
                    full, spec.shape, spec.dtype or self.dtype,
                    lambda spec=spec: spec.initial_value(self.rng, self.dtype),
                    trainable=spec.trainable, initialiser=self.initialiser)
            bound[local] = self.params[full]
        layer.bound_params = bound
        return layer


def recurrent(store: ParameterStore, x: Symbol, cell: str, input_size: int, hidden_size: int,
              num_layers: int, steps: int, name: str = "lstm") -> list[Symbol]:
    """Unroll a ``cell`` ("lstm" or "gru") stack over ``steps``; ``x`` is (N, T, input_size).
    Returns the last layer's per-step outputs h_0 .. h_{T-1}, each (N, hidden_size)."""
    gates = {"lstm": 4, "gru": 3}[cell] * hidden_size
    hs: list[Symbol] = []
    for k in range(num_layers):
        proj = RNNProjection(input_size if k == 0 else hidden_size, gates, steps,
                             step_inputs=k > 0, hidden_size=hidden_size)
        proj.name = f"{name}.l{k}.proj"
        store.bind(proj, {"weight": f"{name}.weight_ih_l{k}", "bias": f"{name}.bias_ih_l{k}"})
        gx = proj(x) if k == 0 else proj(*hs)
        gx = list(gx) if isinstance(gx, tuple) else [gx]
        h = named(L.ZeroState(hidden_size), f"{name}.l{k}.h0")(x)
        c = named(L.ZeroState(hidden_size), f"{name}.l{k}.c0")(x) if cell == "lstm" else None
        hs = []
        for t in range(steps):
            layer = L.LSTMCell(hidden_size) if cell == "lstm" else L.GRUCell(hidden_size)
            layer.name = f"{name}.l{k}.t{t}"
            store.bind(layer, {"weight_hh": f"{name}.weight_hh_l{k}",
                               "bias_hh": f"{name}.bias_hh_l{k}"})
            if cell == "lstm":
                h, c = layer(gx[t], h, c)
            else:
                h = layer(gx[t], h)
            hs.append(h)
    return hs


RNNProjection = L.RNNInputProjection


def recurrent_fused(store: ParameterStore, x: Symbol, cell: str, input_size: int,
                    hidden_size: int, num_layers: int, name: str = "lstm",
                    unit_steps: int | None = None, vocab_size: int | None = None,
                    dtype: str = "float32") -> Symbol:
    """One fused ``cell`` stack over ``x`` (N, T, input_size) -> (N, T, hidden_size); its BPTT
    schedule is a per-step option the plan sets (:mod:`minidl.memory.options.bptt_options`). With
    ``vocab_size``, ``x`` is (N, T) tokens and the layer owns the embedding (bound as
    ``embedding.weight``)."""
    cls = {"lstm": L.LSTM, "gru": L.GRU}[cell]
    layer = cls(input_size, hidden_size, num_layers, unit_steps=unit_steps or UNIT_STEPS,
                vocab_size=vocab_size, dtype=dtype)
    layer.name = name
    # parameters drawn in the unrolled form's order (projection, then cell, per layer), so
    # that both forms start from the same weights for a seed
    order = ["embedding"] + [f"{w}_l{k}" for k in range(num_layers)
                             for w in ("weight_ih", "bias_ih", "weight_hh", "bias_hh")]
    store.bind(layer, {local: "embedding.weight" if local == "embedding" else f"{name}.{local}"
                       for local in layer.param_specs()},
               order=[o for o in order if o in layer.param_specs()])
    return layer(x)


class SequenceModel(Network):
    """A network over token sequences whose build depends on the sequence length.

    ``build(store, T)`` returns (inputs, outputs) of the network for T steps, binding every
    parameterised layer through ``store``. The model itself is the build for
    ``default_steps``; :meth:`for_shapes` returns (and caches) the others. Memory choices (a
    fused layer's BPTT schedule) are per-step options of the plan, never a rebuild.
    """

    def __init__(self, build: Callable[[ParameterStore, int], tuple[Any, Any]],
                 default_steps: int, name: str, seed: int = 0, dtype: str = "float32",
                 vocab_size: int | None = None) -> None:
        self._build_fn = build
        self._store = ParameterStore(seed, dtype)
        self.vocab_size = vocab_size
        self._built: dict[int, Network] = {}
        inputs, outputs = build(self._store, default_steps)
        super().__init__(inputs, outputs, name=name, seed=seed, dtype=dtype)
        self._built[default_steps] = self
        self.default_steps = default_steps

    def for_shapes(self, batch_shapes: Sequence[tuple[int, ...]]) -> Network:
        """The build for the sequence length of ``batch_shapes``, cached."""
        shape = tuple(batch_shapes[0])
        if len(shape) < 2 or shape[1] < 1:
            raise ValueError(f"{self.name} takes (batch, time) token arrays; got shape {shape} "
                             "(an empty sequence has nothing to learn from)")
        if shape[1] not in self._built:
            inputs, outputs = self._build_fn(self._store, shape[1])
            self._built[shape[1]] = Network(inputs, outputs, name=f"{self.name}[T={shape[1]}]",
                                            dtype=self.dtype.name)
        return self._built[shape[1]]


def char_rnn(vocab_size: int = 65, embedding_dim: int = 256, hidden_size: int = 256,
             num_layers: int = 2, steps: int = 64, cell: str = "lstm", seed: int = 0,
             dtype: str = "float32", fused: bool = True) -> SequenceModel:
    """Embedding → ``num_layers``-layer LSTM/GRU → Linear over the vocabulary, per time step.

    ``fused`` builds one recurrent node with an internal time loop and BPTT schedule;
    ``fused=False`` unrolls one node per layer and step (see the module docstring)."""

    def build(store: ParameterStore, T: int):
        x = Input((T,), dtype="int64", name="tokens")
        if fused:  # the embedding lives in the recurrent node: a table gather per step
            y = recurrent_fused(store, x, cell, embedding_dim, hidden_size, num_layers,
                                name=cell, vocab_size=vocab_size, dtype=dtype)
        else:
            emb = store.bind(named(L.Embedding(vocab_size, embedding_dim, dtype=dtype),
                                    "embedding"), {"weight": "embedding.weight"})
            hs = recurrent(store, emb(x), cell, embedding_dim, hidden_size, num_layers, T,
                           name=cell)
            y = named(L.TimeStack(), "stack")(*hs) if T > 1 else hs[0]
        fc = store.bind(named(L.Linear(hidden_size, vocab_size), "fc"),
                        {"weight": "fc.weight", "bias": "fc.bias"})
        return x, fc(y)

    name = f"char-{cell}" if fused else f"char-{cell}-unrolled"
    return SequenceModel(build, steps, name=name, seed=seed, dtype=dtype,
                         vocab_size=vocab_size)


def sequence_classifier(vocab_size: int, num_classes: int, embedding_dim: int = 64,
                        hidden_size: int = 128, num_layers: int = 1, steps: int = 32,
                        cell: str = "lstm", seed: int = 0) -> SequenceModel:
    """Embedding → LSTM/GRU → Linear on the last step's hidden state: one label per sequence."""

    def build(store: ParameterStore, T: int):
        x = Input((T,), dtype="int64", name="tokens")
        emb = store.bind(named(L.Embedding(vocab_size, embedding_dim), "embedding"),
                         {"weight": "embedding.weight"})
        hs = recurrent(store, emb(x), cell, embedding_dim, hidden_size, num_layers, T, cell)
        fc = store.bind(named(L.Linear(hidden_size, num_classes), "fc"),
                        {"weight": "fc.weight", "bias": "fc.bias"})
        return x, fc(hs[-1])

    return SequenceModel(build, steps, name=f"{cell}-classifier", seed=seed)
