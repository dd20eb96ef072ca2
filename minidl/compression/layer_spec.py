"""Which parameters Deep Compression compresses, and per-layer settings such as
``--prune 0.9`` or ``--bits conv=8,fc=5``.

The compressible parameters are the ``weight`` of every convolution (kind ``conv``) and fully
connected layer (kind ``fc``); everything else (biases, BatchNorm parameters and statistics)
is stored as it is. A setting is a comma list of ``KEY=VALUE`` and at most one bare
``VALUE`` (the default); a key is a kind (``conv``, ``fc``) or a layer name (``conv1``), and
a layer's name wins over its kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..layers import Conv2d, Linear
from ..net.graph import Network
from ..net.parameter import Parameter

KINDS = ("conv", "fc")


@dataclass(frozen=True)
class Compressible:
    """One compressible weight: its layer, the layer's kind and the parameter."""

    layer: str
    kind: str
    param: Parameter


def compressible_weights(net: Network) -> list[Compressible]:
    """The weights of ``net``'s convolutions and linear layers, in layer order."""
    out = []
    for node in net.nodes:
        kind = "conv" if isinstance(node.layer, Conv2d) else \
            "fc" if isinstance(node.layer, Linear) else None
        params = net.layer_params(node.name)
        if kind is not None and "weight" in params:
            out.append(Compressible(node.name, kind, params["weight"]))
    return out


@dataclass(frozen=True)
class LayerSetting:
    """A parsed setting: the default (``None``: none given) and the per-key values."""

    text: str
    default: Any
    by_key: dict[str, Any]

    def for_layer(self, layer: str, kind: str) -> Any:
        """The value for ``layer`` of ``kind`` (its name, else its kind, else the default)."""
        if layer in self.by_key:
            return self.by_key[layer]
        return self.by_key.get(kind, self.default)


def parse_setting(text: str, flag: str, convert: Callable[[str], Any],
                  valid: str, layers: list[str] | None = None) -> LayerSetting:
    """Parse ``text`` (``0.9`` or ``conv=0.6,fc=0.92,conv1=0.3``). ``convert`` turns one value
    into its type, raising ``ValueError`` naming what is valid (``valid``, used in messages).
    With ``layers`` given, a key must be a kind or one of them. Raises ``ValueError`` with one
    line naming the flag and the bad part."""
    default, by_key = None, {}
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            raise ValueError(f"{flag} {text!r}: empty item; expected VALUE or KEY=VALUE, "
                             f"comma-separated")
        key, _, value = part.rpartition("=")
        key = key.strip()
        try:
            v = convert(value.strip())
        except ValueError:
            raise ValueError(f"{flag} {text!r}: bad value {value.strip()!r} in {part!r}; "
                             f"valid: {valid}") from None
        if not key:
            if default is not None:
                raise ValueError(f"{flag} {text!r}: more than one default value")
            default = v
            continue
        if layers is not None and key not in KINDS and key not in layers:
            raise ValueError(f"{flag} {text!r}: unknown layer or kind {key!r}; valid: "
                             f"{', '.join(KINDS + tuple(layers))}")
        by_key[key] = v
    return LayerSetting(str(text), default, by_key)


def fraction(text: str) -> float:
    """A pruned fraction in [0, 1)."""
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise ValueError(text)
    return v


def bit_width(text: str) -> int:
    """A number of bits in [1, 12]."""
    v = int(text)
    if not 1 <= v <= 12:
        raise ValueError(text)
    return v
