"""A user's own model on the command line: ``minidl plan mypackage.nets:build``, as
``accelerate estimate-memory`` takes any model. ``MODULE:FUNCTION`` names a function that
returns a :class:`~minidl.net.graph.Network`, or a :class:`~minidl.net.module.Module` subclass
(``mypackage.nets:Net``, constructed); either gets the keyword arguments among
``input_shape``, ``num_classes`` and ``width`` that it declares (and that were given), and
its network's input shape is the one to use when ``--input`` is not given (a Module built
without one takes ``--input``, or the dataset's shape)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from ..net.graph import Network
from ..net.module import Module

#: ``package.module:function`` (dotted module, a Python name after the colon).
SPEC = re.compile(r"(?P<module>[A-Za-z_][\w.]*):(?P<function>[A-Za-z_]\w*)")


class UserModelError(ValueError):
    """A ``MODULE:FUNCTION`` model that cannot be built (the message is one line)."""


#: The names a Network or Sequential has when its builder gave none.
DEFAULT_NAMES = ("network", "sequential")


def is_user_model(name: str) -> bool:
    """Whether ``name`` names a user's model (``MODULE:FUNCTION``) rather than a built-in."""
    return ":" in name


def model_function(name: str) -> Callable[..., Any]:
    """The function ``MODULE:FUNCTION`` names, imported as ``python -m`` would (the current
    folder first on the path); :class:`UserModelError` saying what is wrong otherwise."""
    match = SPEC.fullmatch(name)
    if match is None:
        raise UserModelError(f"model {name!r}: expected MODULE:FUNCTION (e.g. "
                             "mypackage.nets:build), a dotted module and a function name")
    module_name, function = match["module"], match["function"]
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or module_name
        where = "" if missing != module_name.split(".")[0] else \
            f" (looked in {cwd} and on sys.path)"
        raise UserModelError(f"model {name!r}: no module named {missing!r}{where}") from None
    except Exception as e:  # noqa: BLE001 (the user's module failed while importing)
        raise UserModelError(f"model {name!r}: importing {module_name} raised "
                             f"{type(e).__name__}: {_first_line(e)}") from None
    fn = getattr(module, function, None)
    if fn is None:
        names = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserModelError(f"model {name!r}: {module_name} has no {function!r}"
                             + (f"; its functions: {', '.join(names)}" if names else ""))
    if isinstance(fn, Network) or not callable(fn):
        raise UserModelError(f"model {name!r}: {module_name}.{function} is a "
                             f"{type(fn).__name__}, not a function returning a Network "
                             "(or a minidl.Module class)")
    if isinstance(fn, type) and not issubclass(fn, Module):
        raise UserModelError(f"model {name!r}: {module_name}.{function} is the class "
                             f"{fn.__name__}, not a minidl.Module subclass (or a function "
                             "returning a Network)")
    return fn


def build_user_model(name: str, input_shape: tuple[int, ...] | None = None,
                     num_classes: int | None = None, width: int | None = None) -> Network:
    """Call ``MODULE:FUNCTION`` (or construct ``MODULE:CLASS``, a Module subclass) with the
    arguments it declares among ``input_shape``, ``num_classes`` and ``width`` (those given; a
    function taking ``**kwargs`` gets them all) and check that it returns a :class:`Network`
    (a Module traced, with ``input_shape`` when it was built without one)."""
    fn = model_function(name)
    given = {k: v for k, v in (("input_shape", input_shape), ("num_classes", num_classes),
                               ("width", width)) if v is not None}
    try:
        # (a Module class: its __init__, not the metaclass's __call__(*args, **kwargs))
        params = inspect.signature(fn.__init__ if isinstance(fn, type) else fn).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in given.items() if takes_all or k in params}
    try:
        net = fn(**kwargs)
        if isinstance(net, Module) and not net.traced:
            if input_shape is not None and net.input_shape_given is None:
                net.set_input_shape(input_shape)
            net.parameters()  # (traced now: forward's errors are the model's)
    except Exception as e:  # noqa: BLE001 (the user's function failed)
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UserModelError(f"model {name!r}: {name.split(':')[1]}({args}) raised "
                             f"{type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(net, Network):
        raise UserModelError(f"model {name!r} returned {type(net).__name__}, not a "
                             "minidl Network (minidl.Sequential or minidl.Network)")
    if isinstance(net, Module) and net.input_shapes[0] is None:
        raise UserModelError(f"model {name!r}: {type(net).__name__} has no input shape: give "
                             "--input CxHxW, or input_shape= to its super().__init__()")
    if net.name in DEFAULT_NAMES:  # (unnamed: titled by its function, not "network")
        net.name = name.split(":")[1]
    return net


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
