"""Timing minidl and PyTorch in separate processes, alternated: how the benchmark scripts do it.

PyTorch is never timed in the process that times minidl: in one process each runtime's idle
thread pools (OpenBLAS, OpenMP, Numba) spin for a while after their work and slow the other
(timed right after minidl in the same process, PyTorch took 3.5x its own time on smallcnn).
``ChildProcess(factory, *args)`` builds ``factory(*args)`` in a freshly spawned interpreter
(not forked, which would inherit minidl's modules and threads); ``call(name, *args)`` runs one
of its methods there and returns the result. Arguments and results travel pickled over a pipe
and the object times itself, so no transfer is timed. ``factory`` must be picklable (a
module-level class or function). :func:`require_torch_absent` guards the minidl side, and
:func:`alternate` runs the two in alternating blocks (as ``minidl bench --compare-torch``).
"""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np


def require_torch_absent() -> None:
    """Raise if PyTorch is imported in this process (the one that times minidl)."""
    if "torch" in sys.modules:
        raise RuntimeError("torch is imported in the process that times minidl; PyTorch must "
                           "run in a ChildProcess of its own")


class ChildProcess:
    """``factory(*args)`` built in a spawned process; ``call`` runs its methods there."""

    def __init__(self, factory: Callable[..., Any], *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_conn, factory, args),
                                        daemon=True)
        self._process.start()
        child_conn.close()
        self._receive()  # built, or the child's traceback

    def call(self, method: str, *args: Any) -> Any:
        """The result of ``obj.method(*args)`` run in the child process."""
        self._conn.send((method, args))
        return self._receive()

    def _receive(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._process.join(timeout=10)
            raise RuntimeError("the child process stopped (exit code "
                               f"{self._process.exitcode})") from None
        if not ok:
            raise RuntimeError(f"in the child process:\n{value}")
        return value

    def close(self) -> None:
        """Stop the child process (it ends its loop when asked, or is terminated)."""
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join()
        self._conn.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def median_ms(step: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time (ms) of ``repeats`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3



def alternated_median_ms(calls: list[Callable[[], Any]], repeats: int,
                         warmup: int = 1) -> list[float]:
    """Median wall time (ms) of each of ``calls``, run in turn ``repeats`` times after
    ``warmup`` untimed rounds: in one process, each timed beside the others under the same
    load (an A/B of kernels on a noisy machine)."""
    for _ in range(warmup):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, own in zip(calls, times):
            t = time.perf_counter()
            call()
            own.append(time.perf_counter() - t)
    return [float(np.median(own)) * 1e3 for own in times]

def alternate(rounds: int, block: int, run_minidl: Callable[[int], Any],
              torch_side: ChildProcess | None, torch_method: str) -> dict[str, Any]:
    """``rounds`` blocks of ``block + 1`` runs of minidl (here) then of torch (its process),
    a pause between frameworks; the first run of each block is dropped. Each side returns
    a list of seconds, or a dict of such lists; the kept ones are gathered per side."""
    from minidl.tools.bench import SWITCH_PAUSE_S  # here, not at the top: the child stays light

    out: dict[str, Any] = {}

    def gather(side: str, got: Any) -> None:
        if isinstance(got, dict):
            into = out.setdefault(side, {})
            for k, v in got.items():
                into.setdefault(k, []).extend(v[1:])
        else:
            out.setdefault(side, []).extend(got[1:])

    for _ in range(rounds):
        require_torch_absent()
        gather("minidl", run_minidl(block + 1))
        if torch_side is not None:
            time.sleep(SWITCH_PAUSE_S)
            gather("torch", torch_side.call(torch_method, block + 1))
            time.sleep(SWITCH_PAUSE_S)
    return out


def _serve(conn: Any, factory: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Child side: build the object, then answer ``(method, args)`` messages until ``None``."""
    try:
        obj = factory(*args)
    except Exception:
        conn.send((False, traceback.format_exc()))
        return
    conn.send((True, None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        method, call_args = message
        try:
            conn.send((True, getattr(obj, method)(*call_args)))
        except Exception:
            conn.send((False, traceback.format_exc()))
