"""Saying on stderr when Numba compiles this machine's kernels (the first run on a machine:
tens of seconds of silence otherwise), and how long it took."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ...kernels.jit import CompileWatch


@contextmanager
def compile_notice() -> Iterator[CompileWatch]:
    """Say when kernels start compiling inside the block and, after it, how long they took.
    The watch it yields tells whether anything compiled (``compiled``)."""

    def starting() -> None:
        print("minidl: compiling this machine's kernels (first run only: Numba caches "
              "them on disk)...", file=sys.stderr, flush=True)

    with CompileWatch(on_first_compile=starting) as watch:
        yield watch
    if watch.compiled:
        print(f"minidl: kernels compiled in {watch.seconds:.1f} s", file=sys.stderr,
              flush=True)
