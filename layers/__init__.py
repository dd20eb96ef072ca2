"""minidl.layers: pure math with declared needs (one layer per file). Imports no framework code."""

from .base import Context, Layer, ParamSpec, ShapeError, Symbol
from .relu import ReLU

__all__ = ["Context", "Layer", "ParamSpec", "ShapeError", "Symbol", "ReLU"]
