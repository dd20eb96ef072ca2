"""The closed vocabularies are spoken as enums: no code compares a phase, role, category, device
kind or codec with a string literal (read from the source with ``ast``; only the enums are
imported).

A comparison counts when one side of ``==``, ``!=``, ``in`` or ``not in`` is a string literal,
or a tuple / list / set of them, holding a member value of one of the vocabularies, or when a
``match`` case's pattern is such a literal. Parsing and printing code may read and write the
plain strings (:data:`PARSING_AND_PRINTING`).

Run as a script to print the count per file: ``python tests/test_vocabulary.py``.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

from minidl.memory.ir.names import Category, Codec, DeviceKind, Phase, Role

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("memory", "minidl", "layers", "kernels")

VOCABULARIES = (Phase, Role, Category, DeviceKind, Codec)
WORDS = frozenset(m.value for vocab in VOCABULARIES for m in vocab)

#: Functions (``path::name``) or whole modules (``path``) that parse or print the plain
#: strings, and where a literal is the point:
#: - the enum modules themselves;
#: - the memory spec's parser (flags ``sparse``, ``dpr=fp16`` are spec words, not codecs);
#: - the device factory's parsing of device names (``"cpu"``, ``"cuda:1"``, ``"cuda-strict"``);
#: - the command line's argument parsing and the benchmark's text output (keys of its JSON
#:   record);
#: - kernels: a codec's number format (``precision.code_dtype("fp16")``) and the array
#:   implementation's name (``impl == "cuda"``) are the kernels' own words, below the
#:   framework's vocabulary.
PARSING_AND_PRINTING = frozenset({
    "memory/ir/names.py",
    "memory/ir/config.py",
    "memory/device_factory.py::make_device",
    "minidl/cli.py",
    "minidl/commands/bench.py::print_bench",
    "kernels",
})

#: The same word in another vocabulary: a pickle's ``("_codecs", "encode")`` global. (A
#: parameter's initialisation, ``spec.init == "zeros"``, is told apart by its attribute:
#: :data:`OTHER_VOCABULARY_ATTRIBUTES`.)
OTHER_MEANINGS = frozenset({
    "minidl/datasets/cifar_files.py::find_class",
})
#: Attributes whose values are words of another vocabulary (``ParamSpec.init``'s ``"zeros"``).
OTHER_VOCABULARY_ATTRIBUTES = frozenset({"init"})

def _is_word(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in WORDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_word(e) for e in node.elts)
    return False


def _pattern_is_word(pattern: ast.pattern) -> bool:
    if isinstance(pattern, ast.MatchValue):
        return _is_word(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return any(_pattern_is_word(p) for p in pattern.patterns)
    return False


class _Finder(ast.NodeVisitor):
    """Line numbers and enclosing function of string comparisons in one module."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.scope: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) \
                    and (_is_word(sides[i]) or _is_word(sides[i + 1])) \
                    and not any(isinstance(s, ast.Attribute)
                                and s.attr in OTHER_VOCABULARY_ATTRIBUTES
                                for s in sides[i:i + 2]):
                self.found.append((node.lineno, ".".join(self.scope)))
        self.generic_visit(node)

    def visit_match_case(self, node: ast.match_case) -> None:
        if _pattern_is_word(node.pattern):
            self.found.append((node.pattern.lineno, ".".join(self.scope)))
        self.generic_visit(node)


def _allowed(rel: str, function: str) -> bool:
    return any(rel == p or rel.startswith(p + "/") or f"{rel}::{function}" == p
               for p in PARSING_AND_PRINTING | OTHER_MEANINGS)


def string_comparisons(allowed: bool = False) -> list[tuple[str, int]]:
    """``(file, line)`` of every comparison of a vocabulary word with a string literal,
    outside the allowed places (all of them with ``allowed``)."""
    out = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            finder = _Finder()
            finder.visit(ast.parse(path.read_text(), filename=rel))
            out.extend((rel, line) for line, function in finder.found
                       if allowed or not _allowed(rel, function.split(".")[0]))
    return out


def test_no_vocabulary_word_compared_as_a_string() -> None:
    found = string_comparisons()
    assert not found, "compare with the enums (Phase, Role, Category, DeviceKind, Codec): " \
        + ", ".join(f"{f}:{line}" for f, line in found)


def test_converted_elsewhere_names_real_files() -> None:
    for rel in {p.split("::")[0] for p in PARSING_AND_PRINTING | OTHER_MEANINGS}:
        assert (ROOT / rel).exists(), rel


if __name__ == "__main__":
    everything = "--all" in sys.argv
    counts = Counter(f for f, _ in string_comparisons(allowed=everything))
    for f, n in counts.most_common():
        print(f"{n:4d} {f}")
    print(f"{sum(counts.values()):4d} total")
