"""CuPy's API as the strict test device's oracle: which calls CuPy would accept.

Signatures are read with ``inspect`` or from the first line of CuPy's Cython docstrings
(:func:`_check_call`); ufunc keywords are put to the real CuPy ufunc, which rejects unknown ones
before it touches a device (:func:`_ufunc_accepts`). Only the ``cupy`` package is needed, no GPU.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import numpy as np

__all__ = ["StrictCupyError", "cupy_available"]


class StrictCupyError(TypeError):
    """Code used a device array in a way CuPy would not accept."""


def cupy_available() -> bool:
    """True if the ``cupy`` package imports (no GPU needed)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("the strict cuda test device reads CuPy's API from the cupy package, "
                           "which is not installed: pip install 'minidl[test]' (CuPy's API; "
                           "no GPU needed)") from e
    return cupy


_DOC_SIG = re.compile(r"^[\w.]+\((.*?)\)")


@functools.cache
def _signature(fn: Any) -> inspect.Signature | None:
    """``fn``'s signature, from ``inspect`` or the first line of its (Cython) docstring."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        pass
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    if not doc:
        return None
    m = _DOC_SIG.match(doc[0].strip())
    if m is None:
        return None
    try:
        return inspect.signature(eval(f"lambda {m.group(1)}: None", {}, {}))  # noqa: S307
    except Exception:
        return None


def _check_call(where: str, fn: Any, args: tuple, kwargs: dict, bound_self: bool) -> None:
    sig = _signature(fn)
    if sig is None:
        return
    try:
        if bound_self and next(iter(sig.parameters), None) == "self":
            sig.bind(None, *args, **kwargs)
        else:
            sig.bind(*args, **kwargs)
    except TypeError as e:
        raise StrictCupyError(f"{where}: CuPy's signature {sig} does not accept this call "
                              f"({e})") from None


@functools.cache
def _ufunc_accepts(name: str, method: str, keywords: tuple[tuple[str, Any], ...]) -> str | None:
    """Ask the real CuPy ufunc whether it takes these keywords (``None``) or why not.

    CuPy parses the keyword arguments before it touches a device, so a call with host scalars
    fails with ``TypeError`` naming the keywords if they are wrong, and with a CUDA error (no
    device here) or succeeds if they are right.
    """
    cp = _cupy()
    uf = getattr(cp, name, None)
    if uf is None:
        return f"cupy has no ufunc {name!r}"
    fn = uf if method == "__call__" else getattr(uf, method, None)
    if fn is None:
        return f"cupy.{name} has no method {method!r}"
    kwargs = dict(keywords)
    nin = getattr(uf, "nin", 2)
    args = (np.zeros(2, np.float32),) if method != "__call__" else (np.float32(1),) * nin
    try:
        fn(*args, **kwargs)
    except TypeError as e:
        msg = str(e)
        if "Wrong arguments" in msg or "unexpected keyword" in msg:
            return msg
    except Exception:
        pass
    return None


def _kw_token(v: Any) -> Any:
    """A hashable stand-in for a keyword value: dtypes and strings as they are, else None."""
    if isinstance(v, type) and issubclass(v, np.generic):
        return np.dtype(v)
    if isinstance(v, (np.dtype, str, bool)):
        return v
    return None
