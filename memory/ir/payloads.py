"""What a step or a program carries beyond its tensors: typed, frozen records, never free dicts.

- :class:`OpFacts`: plain facts about a layer's op that memory passes read (a max-pool's window,
  a convolution's geometry, attention's shape, a fused RNN's time units). Layers stay
  framework-free and state them as a plain dict (``Layer.memory_attrs``); lowering turns it
  into an :class:`OpFacts` once (:meth:`OpFacts.of`), refusing a key it does not know.
- :class:`CodecStep`: what an encode or decode step added by compression does (its codec, the
  tensor it encodes or decodes, a max-pool's window for packed indices).
- :class:`EncodedInput`: on a backward step whose layer starts from an encoded stash, which
  encoding and which tensor.
- :class:`OpOptions`: the per-op options a plan sets (BPTT schedule, attention form, workspace
  caps, device kind), handed to the layer as a plain dict (:meth:`OpOptions.as_layer_options`).
- :class:`RewriteSummary`: what the rewriting passes did to a program (recomputation's counts,
  compression's encoded stashes and densities), read by the planner's notes and the reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from ...kernels.vocabulary import StashEncoding
from .names import Codec


def _refuse_unknown(kind: str, given: Mapping[str, Any], valid: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise ValueError(f"unknown {kind} {unknown[0]!r} (valid: {', '.join(valid)})")


@dataclass(frozen=True)
class PoolWindow:
    """A pooling op's window: ``size`` elements (``kernel``'s product), its stride and padding."""

    size: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution's geometry beyond its input shape: what its workspace options' estimated
    times are computed from (:mod:`~minidl.memory.options.workspace_times`)."""

    out_channels: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int

    def as_tuple(self) -> tuple:
        """``(out_channels, kernel, stride, padding, dilation, groups)``, the order of
        :func:`~minidl.kernels.convolution.conv_geometry.conv_config`'s arguments."""
        return (self.out_channels, self.kernel, self.stride, self.padding, self.dilation,
                self.groups)


@dataclass(frozen=True)
class AttentionShape:
    """An attention op's problem: batch, sequence length, model width, heads, whether it is
    causal and whether it drops attention weights out."""

    batch: int
    seq: int
    dim: int
    heads: int
    causal: bool
    dropout: bool


@dataclass(frozen=True)
class OpFacts:
    """Plain facts memory passes need about one op (none for most ops)."""

    #: A max-pool's window (its argmax stash packs to ``index_bits(size)`` bits per entry).
    pool: PoolWindow | None = None
    #: A convolution's geometry (its workspace caps' estimated times are computed from it).
    convolution: ConvGeometry | None = None
    #: Attention's shape (its memory forms are chosen from it).
    attention: AttentionShape | None = None
    #: The time units a fused RNN's BPTT schedule must cover.
    time_units: int | None = None

    #: The keys ``Layer.memory_attrs`` may return.
    LAYER_KEYS = ("window", "kernel", "stride", "padding", "convolution", "attention",
                  "time_units")

    @classmethod
    def of(cls, facts: Mapping[str, Any]) -> OpFacts:
        """The facts a layer stated as a plain dict (``Layer.memory_attrs``); an unknown key
        fails naming the valid ones."""
        if not facts:
            return _NO_FACTS
        _refuse_unknown("memory fact", facts, cls.LAYER_KEYS)
        pool = None
        if "window" in facts:
            pool = PoolWindow(int(facts["window"]), tuple(facts["kernel"]),
                              tuple(facts["stride"]), tuple(facts["padding"]))
        convolution = None
        if "convolution" in facts:
            c = facts["convolution"]
            _refuse_unknown("convolution fact", c, tuple(f.name for f in fields(ConvGeometry)))
            convolution = ConvGeometry(int(c["out_channels"]), tuple(c["kernel"]),
                                       tuple(c["stride"]), tuple(c["padding"]),
                                       tuple(c["dilation"]), int(c["groups"]))
        attention = None
        if "attention" in facts:
            a = facts["attention"]
            _refuse_unknown("attention fact", a, tuple(f.name for f in fields(AttentionShape)))
            attention = AttentionShape(int(a["batch"]), int(a["seq"]), int(a["dim"]),
                                       int(a["heads"]), bool(a["causal"]), bool(a["dropout"]))
        units = facts.get("time_units")
        return cls(pool=pool, convolution=convolution, attention=attention,
                   time_units=None if units is None else int(units))


_NO_FACTS = OpFacts()


@dataclass(frozen=True)
class CodecStep:
    """An encode or decode step's work: ``codec`` applied to tensor ``source`` (the encoded
    form is the step's write for an encode, its read for a decode); ``window``: the max-pool's
    window when the codec packs argmax indices (``poolidx``)."""

    codec: Codec
    source: int
    window: PoolWindow | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec.of(self.codec))


@dataclass(frozen=True)
class EncodedInput:
    """A backward step that starts from an encoded stash: the ``encoding`` the layer's
    ``backward_from_encoded`` takes (``"sign"``, ``"packed_argmax"``) and the ``tensor``
    holding it."""

    encoding: StashEncoding
    tensor: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoding", StashEncoding.of(self.encoding))


@dataclass(frozen=True)
class OpOptions:
    """The per-op options a plan sets on a step (each layer names those it takes in
    ``Layer.option_names``); ``None``: not set."""

    #: A fused RNN's BPTT schedule (:mod:`~minidl.memory.options.bptt_options`).
    bptt: Any = None
    #: Attention's memory form (:mod:`~minidl.memory.options.attention_options`).
    attn: str | None = None
    #: A convolution's workspace cap in bytes, or a (forward, backward) pair of caps
    #: (:mod:`~minidl.memory.options.workspace_caps`).
    conv_ws: Any = None
    #: The kind of device the op runs on (``"cpu"`` / ``"cuda"``), for layers whose
    #: declarations depend on it.
    device_kind: str | None = None

    #: Every option name a layer may declare.
    NAMES = ("bptt", "attn", "conv_ws", "device_kind")

    @classmethod
    def of(cls, options: Mapping[str, Any] | OpOptions | None) -> OpOptions:
        """Options from a plain ``{name: value}`` mapping; an unknown name fails naming the
        valid ones."""
        if isinstance(options, OpOptions):
            return options
        if not options:
            return _NO_OPTIONS
        _refuse_unknown("per-op option", options, cls.NAMES)
        return cls(**options)

    @cached_property
    def as_layer_options(self) -> dict[str, Any]:
        """The options set, as the plain dict a layer reads (``ctx.options``); the same dict
        on every call: read it, never change it."""
        return {name: getattr(self, name) for name in self.NAMES
                if getattr(self, name) is not None}

    def __contains__(self, name: object) -> bool:
        return name in self.as_layer_options

    def __getitem__(self, name: str) -> Any:
        """The option ``name``'s value; KeyError when it is not set."""
        return self.as_layer_options[name]

    def get(self, name: str, default: Any = None) -> Any:
        """The option ``name``'s value, or ``default`` when it is not set."""
        return self.as_layer_options.get(name, default)


_NO_OPTIONS = OpOptions()


@dataclass(frozen=True)
class RecomputeSummary:
    """What recomputation did to a program: FLOPs and forward steps computed again per
    iteration, layers dropped, checkpoints kept."""

    recomputed_flops: int = 0
    recomputed_steps: int = 0
    dropped_layers: int = 0
    checkpoints: int = 0


@dataclass(frozen=True)
class CompressionSummary:
    """What compression did to a program: the codec of each encoded stash, by tensor name,
    and each sparse one's density (``None``: assumed until measured)."""

    encoded: Mapping[str, str]
    sparse_densities: Mapping[str, float | None]


@dataclass(frozen=True)
class RewriteSummary:
    """The rewriting passes' record on a program (``None``: that pass did not run)."""

    recompute: RecomputeSummary | None = None
    compression: CompressionSummary | None = None
