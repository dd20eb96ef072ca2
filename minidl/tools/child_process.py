"""Code timed in a process of its own: an object built in a fresh interpreter, its methods
called from here.

PyTorch is never timed in the process that times minidl: in one process each runtime's idle
thread pools (OpenBLAS, OpenMP, Numba) spin for a while after their work and slow the other
(timed right after minidl in the same process, PyTorch took 3.5x its own time on smallcnn).
``ChildProcess(factory, *args)`` builds ``factory(*args)`` in a new interpreter (started, not
forked: it inherits neither minidl's modules nor its threads, only this one's ``sys.path``);
``call(name, *args)`` runs one of its methods there and returns the result. Arguments and
results travel pickled over the child's stdin and stdout (its own prints go to stderr), and
the object times itself, so no transfer is timed. ``factory`` and the arguments must be
picklable: module-level classes and functions, ``functools.partial`` of them; those of the
script run as ``__main__`` are found by loading that script in the child under the name
``__mp_main__`` (as :mod:`multiprocessing` does), its ``if __name__ == "__main__"`` block not
run. :func:`alternate` runs this process's side and the child's in alternating blocks (as
``minidl bench --compare-torch``).
"""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import pickle
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import IO, Any

__all__ = ["SWITCH_PAUSE_S", "ChildProcess", "alternate", "serve"]

#: Seconds between one side's block of runs and the other's (spinning threads settle).
SWITCH_PAUSE_S = 0.2

#: The child's command: the serving loop of :func:`serve`.
_SERVE = "from minidl.tools.child_process import serve; serve()"
#: Each message to the child: its length in bytes, then the pickle.
_LENGTH = struct.Struct("<Q")


class ChildProcess:
    """``factory(*args)`` built in a child process; :meth:`call` runs its methods there.

    ``name`` says which process in errors: ``"the {name} stopped (exit code N)"`` when the
    child ends unasked, ``"in the {name}:"`` and its traceback when a call raises there
    (:class:`RuntimeError` both). Pickling errors of ``factory`` and ``args`` are raised here,
    before the child starts."""

    def __init__(self, factory: Callable[..., Any], *args: Any,
                 name: str = "child process") -> None:
        self.name = name
        setup = pickle.dumps((sys.path, _main_file()))
        built = pickle.dumps((factory, args))
        self._process = subprocess.Popen([sys.executable, "-c", _SERVE],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._send(setup)
        self._send(built)
        self._receive()  # built, or the child's traceback

    def call(self, method: str, *args: Any) -> Any:
        """The result of ``obj.method(*args)`` run in the child process."""
        self._send(pickle.dumps((method, args)))
        return self._receive()

    def _send(self, data: bytes) -> None:
        try:
            self._process.stdin.write(_LENGTH.pack(len(data)) + data)
            self._process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # (the child has ended: _receive says so)

    def _receive(self) -> Any:
        try:
            ok, value = pickle.load(self._process.stdout)
        except EOFError:
            raise RuntimeError(f"the {self.name} stopped (exit code "
                               f"{self._process.wait(timeout=10)})") from None
        if not ok:
            raise RuntimeError(f"in the {self.name}:\n{value}")
        return value

    def close(self) -> None:
        """Stop the child process (it ends its loop when its stdin closes, or is killed)."""
        try:
            self._process.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def alternate(rounds: int | Iterable[Any], block: int, run_here: Callable[[int], Any],
              child: ChildProcess | None, method: str,
              before_round: Callable[[], None] | None = None,
              sides: tuple[str, str] = ("minidl", "torch")) -> dict[str, Any]:
    """``rounds`` rounds (a count, or an iterable of them such as a progress bar) of
    ``run_here(block + 1)`` in this process, then, with a ``child``, a pause
    (:data:`SWITCH_PAUSE_S`), ``child.call(method, block + 1)`` and a pause again;
    ``before_round()`` (when given) starts each round. Each side returns a list of seconds,
    or a dict of such lists; the first of each list is dropped (the block's first run) and
    the others are gathered by side, under ``sides`` (this process's name, the child's)."""
    here, there = sides
    out: dict[str, Any] = {}

    def gather(side: str, got: Any) -> None:
        if isinstance(got, dict):
            into = out.setdefault(side, {})
            for k, v in got.items():
                into.setdefault(k, []).extend(v[1:])
        else:
            out.setdefault(side, []).extend(got[1:])

    for _ in range(rounds) if isinstance(rounds, int) else rounds:
        if before_round is not None:
            before_round()
        gather(here, run_here(block + 1))
        if child is not None:
            time.sleep(SWITCH_PAUSE_S)
            gather(there, child.call(method, block + 1))
            time.sleep(SWITCH_PAUSE_S)
    return out


def _main_file() -> str | None:
    """The script this process runs as ``__main__`` (None: none, or a package's
    ``__main__.py``, which is never loaded again)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None or os.path.basename(path) == "__main__.py":
        return None
    return os.path.abspath(path)


class _Unpickler(pickle.Unpickler):
    """Finds the parent's ``__main__`` names in its script, loaded here as ``__mp_main__``."""

    def __init__(self, file: IO[bytes], main_file: str | None) -> None:
        super().__init__(file)
        self.main_file = main_file

    def find_class(self, module: str, name: str) -> Any:
        if module == "__main__" and self.main_file is not None:
            return functools.reduce(getattr, name.split("."), _load_main(self.main_file))
        return super().find_class(module, name)


#: The parent's script, once loaded (by path).
_MAIN: dict[str, ModuleType] = {}


def _load_main(path: str) -> ModuleType:
    """The parent's script as the module ``__mp_main__`` (loaded once; its
    ``if __name__ == "__main__"`` block not run)."""
    if path not in _MAIN:
        spec = importlib.util.spec_from_file_location("__mp_main__", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["__mp_main__"] = module  # (what multiprocessing's children do)
        spec.loader.exec_module(module)
        _MAIN[path] = module
    return _MAIN[path]


def serve() -> None:
    """Child side of :class:`ChildProcess`: take the parent's ``sys.path``, build the object,
    then answer each ``(method, args)`` on stdin with ``(ok, result or traceback)`` until
    stdin closes."""
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (prints never mix into the replies)

    def reply(ok: bool, value: Any) -> None:
        try:
            data = pickle.dumps((ok, value))
        except Exception:
            data = pickle.dumps((False, traceback.format_exc()))
        replies.write(data)
        replies.flush()

    path, main_file = pickle.loads(_read(requests))
    sys.path[:] = path
    try:
        factory, args = _Unpickler(io.BytesIO(_read(requests)), main_file).load()
        obj = factory(*args)
    except Exception:
        reply(False, traceback.format_exc())
        return
    reply(True, None)
    while (message := _read(requests)) is not None:
        try:
            method, args = _Unpickler(io.BytesIO(message), main_file).load()
            result = getattr(obj, method)(*args)
        except Exception:
            reply(False, traceback.format_exc())
        else:
            reply(True, result)


def _read(stream: IO[bytes]) -> bytes | None:
    """The next message on ``stream`` (None: the parent closed it)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    return stream.read(_LENGTH.unpack(head)[0])
