"""The sizes of the house (issue 48), read from the source with ``ast`` (nothing is imported):

* no constructor over :data:`MAX_CONSTRUCTOR_PARAMETERS` parameters outside ``kernels`` (an
  explicit ``__init__``'s, or the fields a dataclass / NamedTuple's generated one takes);
* no class over :data:`MAX_CLASS_LINES` lines or :data:`MAX_PUBLIC_METHODS` public methods in
  ``memory`` and ``minidl/train``;
* no flat folder over :data:`MAX_FOLDER_MODULES` modules (the library, tests and benchmarks);
* no source file over :data:`MAX_FILE_LINES` lines (issue 37: a module read in one sitting),
  in the library, tests and benchmarks.

Run as a script to print every class and folder over a limit: ``python tests/test_house_sizes.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("memory", "minidl", "layers", "kernels")
MAX_CONSTRUCTOR_PARAMETERS = 10
MAX_CLASS_LINES = 300
MAX_PUBLIC_METHODS = 12
MAX_FOLDER_MODULES = 20
MAX_FILE_LINES = 500


def _python_files(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _decorator_name(d: ast.expr) -> str:
    target = d.func if isinstance(d, ast.Call) else d
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _is_class_var(annotation: ast.expr) -> bool:
    target = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "ClassVar"


def _field_in_init(node: ast.AnnAssign) -> bool:
    """Whether a dataclass field is a parameter of the generated ``__init__``."""
    if _is_class_var(node.annotation):
        return False
    value = node.value
    if isinstance(value, ast.Call) and _decorator_name(value) == "field":
        return not any(k.arg == "init" and isinstance(k.value, ast.Constant)
                       and k.value.value is False for k in value.keywords)
    return True


def constructor_parameters(cls: ast.ClassDef) -> int | None:
    """How many parameters the class's constructor takes (``self`` not counted), or None
    when the class defines none of its own (nor is a dataclass / NamedTuple)."""
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            a = item.args
            return len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)
    generated = (any(_decorator_name(d) == "dataclass" for d in cls.decorator_list)
                 or any(getattr(b, "id", getattr(b, "attr", "")) == "NamedTuple"
                        for b in cls.bases))
    if not generated:
        return None
    return sum(1 for item in cls.body
               if isinstance(item, ast.AnnAssign) and _field_in_init(item))


def _classes(path: Path) -> Iterator[ast.ClassDef]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            yield node


def wide_constructors() -> dict[str, int]:
    """``path::Class`` -> parameters, for constructors over the limit outside kernels."""
    out = {}
    for path in _python_files(*(f for f in LIBRARY if f != "kernels")):
        for cls in _classes(path):
            n = constructor_parameters(cls)
            if n is not None and n > MAX_CONSTRUCTOR_PARAMETERS:
                out[f"{path.relative_to(ROOT)}::{cls.name}"] = n
    return out


def big_classes() -> dict[str, tuple[int, int]]:
    """``path::Class`` -> (lines, public methods), for classes of memory and minidl/train
    over either limit."""
    out = {}
    for path in _python_files("memory", "minidl/train"):
        for cls in _classes(path):
            lines = cls.end_lineno - cls.lineno + 1
            public = sum(1 for item in cls.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and not item.name.startswith("_"))
            if lines > MAX_CLASS_LINES or public > MAX_PUBLIC_METHODS:
                out[f"{path.relative_to(ROOT)}::{cls.name}"] = (lines, public)
    return out


def crowded_folders() -> dict[str, int]:
    """Folder -> modules directly in it, for folders over the limit."""
    counts: dict[str, int] = {}
    for path in _python_files(*LIBRARY, "tests", "benchmarks"):
        if path.name != "__init__.py":
            folder = str(path.parent.relative_to(ROOT))
            counts[folder] = counts.get(folder, 0) + 1
    return {f: n for f, n in counts.items() if n > MAX_FOLDER_MODULES}


def long_files() -> dict[str, int]:
    """Library, test and benchmark files over the line limit."""
    return {str(p.relative_to(ROOT)): n for p in _python_files(*LIBRARY, "tests", "benchmarks")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}


def test_no_constructor_over_the_limit() -> None:
    wide = wide_constructors()
    assert not wide, f"over {MAX_CONSTRUCTOR_PARAMETERS} constructor parameters: {wide}"


def test_no_class_over_the_limits() -> None:
    big = big_classes()
    assert not big, (f"over {MAX_CLASS_LINES} lines or {MAX_PUBLIC_METHODS} public methods "
                     f"(lines, public methods): {big}")


def test_no_flat_folder_over_the_limit() -> None:
    crowded = crowded_folders()
    assert not crowded, f"over {MAX_FOLDER_MODULES} modules in one folder: {crowded}"


def test_no_source_file_over_the_limit() -> None:
    long = long_files()
    assert not long, f"over {MAX_FILE_LINES} lines (split by meaning): {long}"


def test_the_counts_see_what_they_count() -> None:
    source = ast.parse(
        "from dataclasses import dataclass, field\n"
        "from typing import ClassVar, NamedTuple\n"
        "@dataclass(frozen=True)\n"
        "class D:\n"
        "    a: int\n    b: int = 0\n    c: ClassVar[int] = 1\n"
        "    d: list = field(default_factory=list)\n    e: int = field(init=False)\n"
        "class N(NamedTuple):\n    a: int\n    b: str\n"
        "class I:\n    def __init__(self, a, b=1, *, c):\n        pass\n"
        "class Plain:\n    x = 1\n")
    found = {c.name: constructor_parameters(c) for c in ast.walk(source)
             if isinstance(c, ast.ClassDef)}
    assert found == {"D": 3, "N": 2, "I": 3, "Plain": None}


if __name__ == "__main__":
    for title, found in (("constructors", wide_constructors()), ("classes", big_classes()),
                         ("folders", crowded_folders()), ("files", long_files())):
        for name, value in sorted(found.items()):
            print(f"{title}: {name}: {value}")
    sys.exit(0)
