"""The memory spec: a comma list of flags, the same in the API and on the command line.

A parsed spec (:class:`MemoryConfig`) keeps the flags as written and reads their values typed:
the policies are the enums below (members are also their strings, as in :mod:`.names`), sizes
and counts ``int``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .names import Codec, Name
from .units import parse_size, size_text


class SwapPolicy(Name):
    """Which feature maps ``swap=`` offloads."""

    CONV = "conv"  # those read by a convolution's forward (vDNN_conv)
    ALL = "all"  # every feature map (vDNN_all)
    AUTO = "auto"  # those whose transfer hides behind compute, by measured step times


class RecomputePolicy(Name):
    """How ``recompute=`` chooses its checkpoints (:mod:`~..passes.recompute`)."""

    SQRT = "sqrt"  # every sqrt(n)-th articulation point (Chen et al.)
    SPEED = "speed"  # expensive ops kept, each segment recomputed once (SuperNeurons)
    MEMORY = "memory"  # expensive ops kept, recomputed per backward step
    COST = "cost"  # memory's, switched to speed's per segment while the peak holds


class PlannerChoice(Name):
    """How ``auto`` chooses, when not the frontier (``planner=``)."""

    GREEDY = "greedy"
    OPTIMAL = "optimal"


class OnlyAction(Name):
    """The one kind of action ``only=`` restricts ``auto`` to."""

    RECOMPUTE = "recompute"
    SWAP = "swap"


class OffloadPolicy(Name):
    """What persistent state ``offload=`` keeps on the host (ZeRO-Offload)."""

    OPTIMIZER = "optimizer"  # optimizer state and master weights; gradients stream there
    #: also the parameters: streamed in from the host before each step that reads them
    PARAMETERS = "parameters"


#: Reduced precisions ``dpr=`` may keep stashes at.
DPR_CODECS = (Codec.FP16, Codec.BF16, Codec.FP8)


def _values(vocabulary: tuple[Name, ...] | type[Name]) -> tuple[str, ...]:
    return tuple(m.value for m in vocabulary)

#: Known flags: name -> (allowed values or None for a bare flag, one-line description).
FLAGS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "none": (None, "network-wide allocation: every feature and gradient map lives all iteration"),
    "reuse": (None, "liveness: free each tensor after its last use; input gradients over "
                    "output gradients within a layer (Layrub)"),
    "inplace": (None, "outputs written over dead inputs where the op allows (ReLU, Add, ...)"),
    "static": (None, "offsets planned ahead from lifetimes: no run-time search, no "
                     "fragmentation"),
    "swap": (_values(SwapPolicy), "offload feature maps to host in forward, prefetch them "
                                      "ahead of use in backward (vDNN, Capuchin)"),
    "cache": (None, "offloaded tensors stay on device while memory allows, LRU eviction "
                    "(SuperNeurons)"),
    "recompute": (_values(RecomputePolicy),
                  "drop feature maps in forward, recompute them from checkpoints in backward "
                  "(Chen et al., SuperNeurons); implies reuse"),
    "bptt": (("<int>",), "fused recurrent layers keep at most N hidden states over time, "
                         "placed by dynamic programming at the fewest recomputed steps "
                         "(Gruslys et al.); recompute=sqrt keeps every sqrt(U)-th"),
    "binarize": (None, "ReLU→Pool: 1-bit ReLU masks and packed pool indices instead of 32-bit "
                       "maps (Gist)"),
    "sparse": (None, "ReLU→Conv: conv inputs kept sparse (CSR / zero-value compression) "
                     "between forward and backward (Gist SSDC)"),
    "dpr": (_values(DPR_CODECS), "other stashed feature maps kept at reduced precision "
                                     "(lossy, opt-in; Gist DPR)"),
    "auto": (None, "choose keep / swap / recompute per feature map to fit budget=SIZE at the "
                   "least estimated time (Capuchin, moDNN)"),
    "budget": (("<size>",), "device bytes the auto planner must fit, e.g. budget=2GiB"),
    "planner": (_values(PlannerChoice), "how auto chooses (default: the frontier, block-chain "
                                       "dynamic programming over keep / swap / recompute): "
                                       "greedy, a Capuchin-style walk; optimal, a mixed-integer "
                                       "program solved by HiGHS, taken when it fits at no more "
                                       "estimated time (Checkmate + swapping)"),
    "only": (_values(OnlyAction), "restrict auto to one kind of action: recompute only "
                                    "(Checkmate's setting) or swap only (vDNN's)"),
    "split": (("<int>",), "run each batch as K micro-batches, accumulating weight gradients "
                          "(moDNN's batch splitting; auto picks K when nothing else fits)"),
    "offload": (_values(OffloadPolicy), "optimizer state (and master weights) on the host, "
                                        "the update run there; gradients copied to the host "
                                        "as backward writes them, parameters back after the "
                                        "update (ZeRO-Offload); parameters: also the "
                                        "parameters, streamed in from the host ahead of each "
                                        "step that reads them (ZeRO-Infinity)"),
    "prefetch": (("<int>",), "offload=parameters: fetch a parameter N parameter-reading steps "
                             "ahead of its use (default 2)"),
    "inflight": (("<size>",), "offload=parameters: at most SIZE of parameters fetched ahead "
                              "and not yet used (default 1GiB; FSDP's limit on gathers in "
                              "flight)"),
    "zero": (("1", "2", "3"), "data-parallel ranks shard the optimizer state (1), also the "
                              "gradients (2), also the parameters (3) (ZeRO, DeepSpeed)"),
}

#: Presets: name -> the spec they expand to.
PRESETS: dict[str, str] = {
    "layrub": "reuse,inplace",
    # vDNN allocates from a pool sized ahead (cnmem): static offsets, no fragmentation
    "vdnn": "reuse,swap=conv,static",
    "vdnn-all": "reuse,swap=all,static",
    "superneurons": "reuse,inplace,swap=conv,cache,recompute=cost",
    "gist": "reuse,inplace,binarize,sparse",
    "all": "reuse,inplace,binarize,sparse,swap=conv,recompute=cost",
}


def valid_flags_text() -> str:
    parts = []
    for name, (values, _) in FLAGS.items():
        parts.append(f"{name}={'|'.join(values)}" if values else name)
    parts.extend(f"{p} (preset: {s})" for p, s in PRESETS.items())
    return ", ".join(parts)


#: Flags the auto planner would ignore (it makes those choices itself, or has no encoding
#: choice): refused beside ``auto`` rather than silently dropped.
AUTO_EXCLUDES = ("swap", "cache", "binarize", "sparse", "dpr")


def _expand(spec: str) -> list[tuple[str, str]]:
    """``(flag, value)`` pairs of a spec in order, presets expanded (a flag given before a
    preset keeps its value)."""
    pairs: list[tuple[str, str]] = []
    for raw in spec.split(","):
        item = raw.strip().lower()
        if not item:
            continue
        if item in PRESETS:
            pairs.extend((k, v) for k, v in _expand(PRESETS[item])
                         if k not in {n for n, _ in pairs})
            continue
        name, _, value = item.partition("=")
        pairs.append((name, value))
    return pairs


def _checked_value(name: str, value: str) -> str:
    """``value`` of flag ``name`` in its canonical form (sizes in bytes); a ``ValueError``
    naming what is valid otherwise."""
    if name not in FLAGS:
        raise ValueError(f"unknown memory flag {name!r}; valid: {valid_flags_text()}")
    values, _ = FLAGS[name]
    if values is None:
        if value:
            raise ValueError(f"memory flag {name!r} takes no value (got {value!r})")
    elif values == ("<size>",):
        try:
            value = str(parse_size(value))
        except ValueError as e:
            raise ValueError(f"memory flag {name!r}: {e}") from None
    elif values == ("<int>",):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"memory flag {name!r} needs a positive integer, got {value!r}")
    elif value not in values:
        raise ValueError(
            f"memory flag {name!r} needs a value in {'|'.join(values)} (got {value!r})")
    return value


def _check_combinations(flags: dict[str, str]) -> None:
    """Flags that make no sense together, refused with what to do instead."""
    if "split" in flags and not flags["split"]:
        raise ValueError("memory flag 'split' needs a value: split=K")
    if flags.get("split", "1") != "1" and flags.get("zero", "0") in ("2", "3"):
        raise ValueError(f"split={flags['split']} cannot be combined with "
                         f"zero={flags['zero']}: micro-batches accumulate full gradients, "
                         "which ZeRO stages 2 and 3 do not keep; use zero=1 with split")
    if "offload" in flags and flags.get("split", "1") != "1":
        raise ValueError(f"split={flags['split']} cannot be combined with offload: gradients "
                         "leave the device as backward writes them, so micro-batches cannot "
                         "accumulate them there; drop split")
    if flags.get("offload") == "parameters" and "zero" in flags:
        raise ValueError("offload=parameters cannot be combined with zero=K yet: the streamed "
                         "parameters need every master weight on each host; use "
                         "offload=optimizer")
    if "offload" in flags and flags.get("zero") == "3":
        raise ValueError("offload cannot be combined with zero=3 yet: use zero=1 or zero=2 "
                         "(each rank's host keeps its shard of the state)")
    for flag in ("prefetch", "inflight"):
        if flag in flags and flags.get("offload") != OffloadPolicy.PARAMETERS:
            raise ValueError(f"memory flag {flag!r} paces streamed parameters: add "
                             "offload=parameters to the spec")
    for flag, usage in (("budget", "budget=SIZE"), ("only", "only=recompute|swap"),
                        ("planner", "planner=greedy|optimal")):
        if flag in flags and "auto" not in flags:
            raise ValueError(f"{usage} is for the auto planner: add 'auto' to the spec")
    ignored = [f for f in AUTO_EXCLUDES if f in flags]
    if "auto" in flags and ignored:
        raise ValueError(
            f"memory flag {ignored[0]!r} cannot be combined with auto: auto chooses keep, "
            f"swap or recompute per feature map itself (on reuse,inplace,static); drop "
            f"{ignored[0]!r} or 'auto'")


def _flag_property(name: str, doc: str) -> property:
    """A bare flag as a ``bool`` attribute."""
    return property(lambda self: name in self.flags, doc=doc)


def _value_property(name: str, vocabulary: type[Name], doc: str) -> property:
    """A flag's value as a member of ``vocabulary`` (``None`` when the flag is not given)."""

    def read(self: MemoryConfig) -> Name | None:
        value = self.flags.get(name)
        return None if value is None else vocabulary.of(value)

    return property(read, doc=doc)


@dataclass(frozen=True)
class MemoryConfig:
    """A parsed memory spec, parsed once: ``flags`` maps each flag to its value ('' for bare
    flags), in the spec's order; the typed attributes below read it (``config.swap`` is a
    :class:`SwapPolicy` or ``None``, ``config.reuse`` a ``bool``, ``config.budget`` bytes or
    ``None``)."""

    flags: dict[str, str] = field(default_factory=dict)

    reuse = _flag_property("reuse", "Free each tensor after its last use.")
    inplace = _flag_property("inplace", "Outputs written over dead inputs where allowed.")
    static = _flag_property("static", "Offsets planned ahead from lifetimes.")
    cache = _flag_property("cache", "Offloaded tensors stay on device while memory allows.")
    binarize = _flag_property("binarize", "1-bit ReLU masks and packed pool indices (Gist).")
    sparse = _flag_property("sparse", "Conv inputs kept sparse after a ReLU (Gist SSDC).")
    auto = _flag_property("auto", "The auto planner chooses keep / swap / recompute.")
    swap = _value_property("swap", SwapPolicy, "Which feature maps to offload, or None.")
    recompute = _value_property("recompute", RecomputePolicy, "Recomputation policy, or None.")
    dpr = _value_property("dpr", Codec, "Reduced precision of other stashes (fp16, bf16, fp8), "
                                        "or None.")
    planner = _value_property("planner", PlannerChoice, "How auto chooses, or None (the "
                                                       "frontier).")
    only = _value_property("only", OnlyAction, "Auto restricted to recompute or swap, or None.")
    offload = _value_property("offload", OffloadPolicy, "Persistent state kept on the host "
                                                       "(``optimizer``), or None.")

    @classmethod
    def parse(cls, spec: str | MemoryConfig | None) -> MemoryConfig:
        """Parse ``"reuse,inplace,swap=conv"``-style specs; unknown flags raise ``ValueError``
        listing the valid ones."""
        if isinstance(spec, MemoryConfig):
            return spec
        if spec is None or not str(spec).strip():
            spec = "none"
        flags: dict[str, str] = {}
        for name, value in _expand(str(spec)):
            flags[name] = _checked_value(name, value)
        _check_combinations(flags)
        if len(flags) > 1:
            flags.pop("none", None)
        if not flags:
            flags["none"] = ""
        return cls(flags)

    def has(self, name: str) -> bool:
        return name in self.flags

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.flags.get(name, default)

    @property
    def bptt(self) -> int | None:
        """Hidden states fused recurrent layers keep over time (``bptt=N``), if given."""
        b = self.flags.get("bptt")
        return int(b) if b else None

    @property
    def split(self) -> int | None:
        """Micro-batches per batch when ``split=K`` is given."""
        s = self.flags.get("split")
        return int(s) if s else None

    @property
    def zero(self) -> int:
        """ZeRO stage (0 without ``zero=K``)."""
        return int(self.flags.get("zero") or 0)

    @property
    def prefetch(self) -> int:
        """``offload=parameters``: how many parameter-reading steps ahead a parameter is
        fetched (``prefetch=N``, default 2)."""
        return int(self.flags.get("prefetch") or 2)

    @property
    def inflight(self) -> int:
        """``offload=parameters``: bytes of parameters fetched ahead and not yet used
        (``inflight=SIZE``, default 1 GiB)."""
        return int(self.flags.get("inflight") or 1 << 30)

    @property
    def budget(self) -> int | None:
        """The auto planner's budget in bytes, if given."""
        b = self.flags.get("budget")
        return int(b) if b else None

    @property
    def spec(self) -> str:
        """The spec in canonical form, as people read it and :meth:`parse` reads it back:
        sizes in the largest unit that divides them exactly (``budget=16GiB``, not
        ``budget=17179869184``)."""
        def item(k: str, v: str) -> str:
            if not v:
                return k
            return f"{k}={size_text(int(v)) if FLAGS.get(k, (None,))[0] == ('<size>',) else v}"

        return ",".join(item(k, v) for k, v in self.flags.items())

    def __str__(self) -> str:
        return self.spec
