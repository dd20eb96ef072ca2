"""Old module paths stay importable after modules moved into sub-packages (import plumbing
with no framework code, kept in the lowest floor so that kernels, memory and minidl all use it).

``install(package, {"pool": "runtime"})`` makes ``package.pool`` (``import``, ``from package
import pool``, attribute access, ``mock.patch("package.pool.X")``) resolve to the one module
object at ``package.runtime.pool``: no copy, so patches and ``isinstance`` agree.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Mapping
from importlib.machinery import ModuleSpec
from types import ModuleType


class _MovedModuleLoader(importlib.abc.Loader):
    """Hands back the module at its new path instead of executing anything."""

    def __init__(self, new_name: str) -> None:
        self.new_name = new_name
        self._real_spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new_name)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._real_spec  # importlib set the alias's spec on the real module


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str, moved: Mapping[str, str]) -> None:
        self.package = package
        self.moved = dict(moved)

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != self.package or name not in self.moved:
            return None
        new_name = f"{self.package}.{self.moved[name]}.{name}"
        return importlib.util.spec_from_loader(fullname, _MovedModuleLoader(new_name))


def install(package: str, moved: Mapping[str, str]) -> Callable[[str], ModuleType]:
    """Register ``package``'s moved modules (old name -> sub-package) and return the
    package's module ``__getattr__``."""
    if not any(isinstance(f, _MovedModuleFinder) and f.package == package
               for f in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder(package, moved))

    def module_getattr(name: str) -> ModuleType:
        if name in moved:
            return importlib.import_module(f"{package}.{moved[name]}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return module_getattr
