"""The memory spec: a comma list of flags, the same in the API and on the command line."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Known flags: name -> (allowed values or None for a bare flag, one-line description).
FLAGS: dict[str, tuple[tuple[str, ...] | None, str]] = {
    "none": (None, "network-wide allocation: every feature and gradient map lives all iteration"),
    "reuse": (None, "liveness: free each tensor after its last use; input gradients over "
                    "output gradients within a layer (Layrub)"),
    "inplace": (None, "outputs written over dead inputs where the op allows (ReLU, Add, ...)"),
    "static": (None, "offsets planned ahead from lifetimes: no run-time search, no "
                     "fragmentation"),
    "swap": (("conv", "all", "auto"), "offload feature maps to host in forward, prefetch them "
                                      "ahead of use in backward (vDNN, Capuchin)"),
    "cache": (None, "offloaded tensors stay on device while memory allows, LRU eviction "
                    "(SuperNeurons)"),
    "recompute": (("sqrt", "speed", "memory", "cost"),
                  "drop feature maps in forward, recompute them from checkpoints in backward "
                  "(Chen et al., SuperNeurons); implies reuse"),
    "bptt": (("<int>",), "fused recurrent layers keep at most N hidden states over time, "
                         "placed by dynamic programming at the fewest recomputed steps "
                         "(Gruslys et al.); recompute=sqrt keeps every sqrt(U)-th"),
    "binarize": (None, "ReLU→Pool: 1-bit ReLU masks and packed pool indices instead of 32-bit "
                       "maps (Gist)"),
    "sparse": (None, "ReLU→Conv: conv inputs kept sparse (CSR / zero-value compression) "
                     "between forward and backward (Gist SSDC)"),
    "dpr": (("fp16", "bf16", "fp8"), "other stashed feature maps kept at reduced precision "
                                     "(lossy, opt-in; Gist DPR)"),
    "auto": (None, "choose keep / swap / recompute per feature map to fit budget=SIZE at the "
                   "least estimated time (Capuchin, moDNN)"),
    "budget": (("<size>",), "device bytes the auto planner must fit, e.g. budget=2GiB"),
    "planner": (("greedy", "optimal"), "how auto chooses: a greedy walk (default) or a "
                                       "mixed-integer program solved by HiGHS, taken when it "
                                       "fits at no more estimated time (Checkmate + swapping)"),
    "only": (("recompute", "swap"), "restrict auto to one kind of action: recompute only "
                                    "(Checkmate's setting) or swap only (vDNN's)"),
    "split": (("<int>",), "run each batch as K micro-batches, accumulating weight gradients "
                          "(moDNN's batch splitting; auto picks K when nothing else fits)"),
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


@dataclass(frozen=True)
class MemoryConfig:
    """A parsed memory spec. ``flags`` maps each flag to its value ('' for bare flags)."""

    flags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str | MemoryConfig | None) -> MemoryConfig:
        """Parse ``"reuse,inplace,swap=conv"``-style specs; unknown flags raise ``ValueError``
        listing the valid ones."""
        if isinstance(spec, MemoryConfig):
            return spec
        if spec is None or not str(spec).strip():
            spec = "none"
        flags: dict[str, str] = {}
        for raw in str(spec).split(","):
            item = raw.strip().lower()
            if not item:
                continue
            if item in PRESETS:
                for k, v in cls.parse(PRESETS[item]).flags.items():
                    flags.setdefault(k, v)
                continue
            name, _, value = item.partition("=")
            if name not in FLAGS:
                raise ValueError(f"unknown memory flag {name!r}; valid: {valid_flags_text()}")
            values, _ = FLAGS[name]
            if values is None and value:
                raise ValueError(f"memory flag {name!r} takes no value (got {value!r})")
            if values == ("<size>",):
                from .units import parse_size

                try:
                    value = str(parse_size(value))
                except ValueError as e:
                    raise ValueError(f"memory flag {name!r}: {e}") from None
            elif values == ("<int>",):
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"memory flag {name!r} needs a positive integer, got "
                                     f"{value!r}")
            elif values is not None and value not in values:
                raise ValueError(
                    f"memory flag {name!r} needs a value in {'|'.join(values)} (got {value!r})"
                )
            flags[name] = value
        if "split" in flags and not flags["split"]:
            raise ValueError("memory flag 'split' needs a value: split=K")
        if flags.get("split", "1") != "1" and flags.get("zero", "0") in ("2", "3"):
            raise ValueError(f"split={flags['split']} cannot be combined with "
                             f"zero={flags['zero']}: micro-batches accumulate full gradients, "
                             "which ZeRO stages 2 and 3 do not keep; use zero=1 with split")
        if "budget" in flags and "auto" not in flags:
            raise ValueError("budget=SIZE is for the auto planner: add 'auto' to the spec")
        if "only" in flags and "auto" not in flags:
            raise ValueError("only=recompute|swap is for the auto planner: add 'auto' to the "
                             "spec")
        if "planner" in flags and "auto" not in flags:
            raise ValueError("planner=greedy|optimal is for the auto planner: add 'auto' to the "
                             "spec")
        if "auto" in flags:
            ignored = [f for f in AUTO_EXCLUDES if f in flags]
            if ignored:
                raise ValueError(
                    f"memory flag {ignored[0]!r} cannot be combined with auto: auto chooses keep, "
                    f"swap or recompute per feature map itself (on reuse,inplace,static); drop "
                    f"{ignored[0]!r} or 'auto'")
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
    def split(self) -> int | None:
        """Micro-batches per batch when ``split=K`` is given."""
        s = self.flags.get("split")
        return int(s) if s else None

    @property
    def zero(self) -> int:
        """ZeRO stage (0 without ``zero=K``)."""
        return int(self.flags.get("zero") or 0)

    @property
    def budget(self) -> int | None:
        """The auto planner's budget in bytes, if given."""
        b = self.flags.get("budget")
        return int(b) if b else None

    @property
    def spec(self) -> str:
        return ",".join(f"{k}={v}" if v else k for k, v in self.flags.items())

    def __str__(self) -> str:
        return self.spec
