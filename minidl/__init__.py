"""minidl: a small, memory-first deep-learning framework.

Define networks as a class (:class:`Module`, PyTorch's way), with :class:`Sequential` or the
functional builder (:func:`Input`, :class:`Network`), train them with :class:`Trainer` under a
memory spec (``"reuse,inplace"``, ...) and ask :func:`dry_run` what any model needs before
running it.
"""

import sys as _sys
from importlib.metadata import PackageNotFoundError, version

from .settings import Settings, set_openblas_thread_timeout

# Before anything loads NumPy (OpenBLAS reads it when it loads): see minidl/settings.py.
set_openblas_thread_timeout()

# the public submodules, reachable as attributes after ``import minidl`` (``minidl.optim.SGD``)
from . import compression, kernels, layers, memory, settings  # noqa: E402
from .analysis import dryrun, estimate, memory_record, report, summary  # noqa: E402
from .analysis.dryrun import dry_run, frontier  # noqa: E402
from .analysis.memory_record import show_memory  # noqa: E402
from .analysis.summary import memory_summary  # noqa: E402
from .compile import deferred  # noqa: E402
from .compile.executor import NonFiniteError  # noqa: E402
from .datasets import data, loaders, text  # noqa: E402
from .distributed import comm  # noqa: E402
from .interop import onnx_export, safetensors_io, torch_bridge  # noqa: E402
from .layers.base import ShapeError  # noqa: E402
from .memory.ir.config import MemoryConfig  # noqa: E402
from .memory.runtime.pool import DeviceOutOfMemory  # noqa: E402
from .net import graph, optim  # noqa: E402
from .net.graph import Input, Network, Sequential  # noqa: E402
from .net.module import Module, ModuleError  # noqa: E402
from .net.parameter import Parameter  # noqa: E402
from .train import callbacks, trainer  # noqa: E402
from .train.loop.fitting import History  # noqa: E402
from .train.trainer import Trainer  # noqa: E402
from .zoo import models, rnn  # noqa: E402

#: The public submodules above, importable by their short names as well as reached as
#: attributes (``from minidl.optim import SGD``, as ``torch.optim``): the same module objects
#: entered in ``sys.modules``, no import hook. Every other module has its one path
#: (docs/ARCHITECTURE.md, "Where each name lives").
PUBLIC_SUBMODULES = ("callbacks", "comm", "data", "deferred", "dryrun", "estimate", "graph",
                     "loaders", "memory_record", "models", "onnx_export", "optim", "report",
                     "rnn", "safetensors_io", "summary", "text", "torch_bridge", "trainer")


for _name in PUBLIC_SUBMODULES:
    _sys.modules.setdefault(f"{__name__}.{_name}", globals()[_name])
del _name


def _installed_version() -> str:
    """The version in the installed package's metadata (pyproject.toml's ``version``)."""
    try:
        return version("minidl")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
    "DeviceOutOfMemory",
    "History",
    "Input",
    "MemoryConfig",
    "Module",
    "ModuleError",
    "Network",
    "NonFiniteError",
    "Parameter",
    "Sequential",
    "Settings",
    "ShapeError",
    "Trainer",
    "callbacks",
    "comm",
    "compression",
    "data",
    "deferred",
    "dry_run",
    "dryrun",
    "estimate",
    "frontier",
    "graph",
    "kernels",
    "layers",
    "loaders",
    "memory",
    "memory_record",
    "memory_summary",
    "models",
    "onnx_export",
    "optim",
    "report",
    "rnn",
    "safetensors_io",
    "settings",
    "show_memory",
    "summary",
    "text",
    "torch_bridge",
    "trainer",
]
