"""Helpers shared by the network builders of :mod:`minidl.zoo.models` and :mod:`minidl.zoo.rnn`."""

from __future__ import annotations

from ..layers.base import Layer


def named(layer: Layer, name: str) -> Layer:
    """``layer`` with its node name set to ``name`` (the name reports and state dicts use)."""
    layer.name = name
    return layer
