"""minidl: a small, memory-first deep-learning framework.

Define networks with :class:`Sequential` or the functional builder (:func:`Input`,
:class:`Network`), train them with :class:`Trainer` under a memory spec (``"reuse,inplace"``,
...) and ask :func:`dry_run` what any model needs before running it.
"""

import os as _os

# OpenBLAS's idle workers spin ~2^28 cycles (~0.1 s) after each threaded call; the fused RNN
# layers' scheduled (recomputing) path runs BLAS on every core, and the spinning then made the
# next Numba ``prange`` kernel (the optimizer) 10x slower (char-lstm, when every step ran that
# way: 122 -> 95 ms per step with 2^22 cycles, ~1.5 ms, still long enough to stay awake between
# the per-step products). Read when OpenBLAS loads, so it only applies if NumPy was not
# imported before minidl; an existing setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "22")

# the public submodules, reachable as attributes after ``import minidl`` (``minidl.optim.SGD``)
from . import (  # noqa: E402
    data,
    dryrun,
    graph,
    kernels,
    layers,
    memory,
    models,
    optim,
    report,
    rnn,
    text,
    torch_bridge,
    trainer,
)
from .dryrun import dry_run  # noqa: E402
from .executor import NonFiniteError  # noqa: E402
from .graph import Input, Network, Sequential  # noqa: E402
from .layers.base import ShapeError  # noqa: E402
from .memory.config import MemoryConfig  # noqa: E402
from .memory.pool import DeviceOutOfMemory  # noqa: E402
from .parameter import Parameter  # noqa: E402
from .trainer import History, Trainer  # noqa: E402


def _installed_version() -> str:
    """The version in the installed package's metadata (pyproject.toml's ``version``)."""
    from importlib.metadata import PackageNotFoundError, version

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
    "ShapeError",
    "Trainer",
    "data",
    "dry_run",
    "dryrun",
    "graph",
    "kernels",
    "layers",
    "memory",
    "models",
    "optim",
    "report",
    "rnn",
    "text",
    "torch_bridge",
    "trainer",
]
