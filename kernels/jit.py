"""Seeing Numba compile.

The first call of a kernel for a new argument signature compiles it (seconds for the conv
kernels); ``@njit(cache=True)`` stores the machine code next to the source (``__pycache__``, or
``NUMBA_CACHE_DIR``), so later processes load it in milliseconds and compile nothing.
:class:`CompileWatch` tells a caller whether, and for how long, a block of code compiled, and
calls it back the moment compilation starts (to say so while the user waits).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from numba.core import event


class CompileWatch(event.Listener):
    """Context manager that watches Numba's compilations inside its block.

    ``on_first_compile`` (optional) is called once, when the first compilation starts; a
    block whose kernels all come from the on-disk cache never calls it. Afterwards
    ``functions`` counts the functions compiled at the outermost level (a kernel and the
    jitted functions it calls count once), ``seconds`` their total compile time and
    ``by_function`` those seconds per function (``module.qualname``).
    """

    def __init__(self, on_first_compile: Callable[[], None] | None = None) -> None:
        self.on_first_compile = on_first_compile
        self.functions = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._depth = 0
        self._outer_start = 0.0
        self.by_function: dict[str, float] = {}

    @property
    def compiled(self) -> bool:
        """Whether anything compiled inside the block."""
        return self.functions > 0

    def on_start(self, ev: event.Event) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            self._outer_start = time.perf_counter()
            first = self.functions == 0
            self.functions += 1
        if first and self.on_first_compile is not None:
            self.on_first_compile()

    def on_end(self, ev: event.Event) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                took = time.perf_counter() - self._outer_start
                self.seconds += took
                fn = ev.data["dispatcher"].py_func
                name = f"{fn.__module__}.{fn.__qualname__}"
                self.by_function[name] = self.by_function.get(name, 0.0) + took

    def __enter__(self) -> CompileWatch:
        event.register("numba:compile", self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        event.unregister("numba:compile", self)
