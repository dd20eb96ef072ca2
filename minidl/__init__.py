"""minidl: a small, memory-first deep-learning framework.

Define networks with :class:`Sequential` or the functional builder (:func:`Input`,
:class:`Network`), train them with :class:`Trainer` under a memory spec (``"reuse,inplace"``,
...) and ask :func:`dry_run` what any model needs before running it.
"""

from importlib.metadata import PackageNotFoundError, version

from .settings import Settings, set_openblas_thread_timeout

# Before anything loads NumPy (OpenBLAS reads it when it loads): see minidl/settings.py.
set_openblas_thread_timeout()

# the public submodules, reachable as attributes after ``import minidl`` (``minidl.optim.SGD``)
from . import (  # noqa: E402
    callbacks,
    data,
    dryrun,
    graph,
    kernels,
    layers,
    memory,
    memory_record,
    models,
    optim,
    report,
    rnn,
    safetensors_io,
    settings,
    summary,
    text,
    torch_bridge,
    trainer,
)
from .dryrun import dry_run, frontier  # noqa: E402
from .executor import NonFiniteError  # noqa: E402
from .fitting import History  # noqa: E402
from .graph import Input, Network, Sequential  # noqa: E402
from .layers.base import ShapeError  # noqa: E402
from .memory.ir.config import MemoryConfig  # noqa: E402
from .memory.runtime.pool import DeviceOutOfMemory  # noqa: E402
from .memory_record import show_memory  # noqa: E402
from .parameter import Parameter  # noqa: E402
from .summary import memory_summary  # noqa: E402
from .trainer import Trainer  # noqa: E402


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
    "Network",
    "NonFiniteError",
    "Parameter",
    "Sequential",
    "Settings",
    "ShapeError",
    "Trainer",
    "callbacks",
    "data",
    "dry_run",
    "dryrun",
    "frontier",
    "graph",
    "kernels",
    "layers",
    "memory",
    "memory_record",
    "memory_summary",
    "models",
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
