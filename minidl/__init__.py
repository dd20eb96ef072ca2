"""minidl: a small, memory-first deep-learning framework.

Define networks with :class:`Sequential` or the functional builder (:func:`Input`,
:class:`Network`), train them with :class:`Trainer` under a memory spec (``"reuse,inplace"``,
...) and ask :func:`dry_run` what any model needs before running it.
"""

from . import layers
from .dryrun import dry_run
from .executor import NonFiniteError
from .graph import Input, Network, Sequential
from .layers.base import ShapeError
from .memory.config import MemoryConfig
from .memory.pool import DeviceOutOfMemory
from .parameter import Parameter
from .trainer import History, Trainer

__version__ = "0.1.0"

__all__ = [
    "DeviceOutOfMemory",
    "History",
    "Input",
    "MemoryConfig",
    "Network",
    "NonFiniteError",
    "Parameter",
    "Sequential",
    "ShapeError",
    "Trainer",
    "dry_run",
    "layers",
]
