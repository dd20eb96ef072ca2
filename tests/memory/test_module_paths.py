"""Every module has one import path, listed in docs/ARCHITECTURE.md ("Where each name lives");
the flat paths of before the sub-packages (served by an import hook until Part 27) are gone."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import minidl

DOC = Path(__file__).resolve().parents[2] / "docs" / "ARCHITECTURE.md"

#: The modules that lived flat in minidl, minidl.memory and minidl.kernels before their
#: sub-packages (the import hook's tables, Part 20 to Part 27).
OLD_FLAT = {
    "minidl": "bench builder callbacks checkpoint comm data data_parallel dataset deferred "
              "dryrun engine estimate executor fitting graph labels loaders lowering "
              "memory_record memory_viz models onnx_export optim parameter report rnn "
              "safetensors_io summary text torch_bridge trainer transformers user_models zero",
    "minidl.memory": "attention_options auto base_plan block_choices bptt bptt_options cache "
                     "capabilities chain codecs compress config cost_model cuda_device device "
                     "frontier host_pool inplace link_emulation liveness network_wide optimal "
                     "optimal_model plan planner pool pool_errors pool_report program recompute "
                     "residency reuse rotor scratch sharing static_plan stream_model "
                     "strict_device swap targets timeline transfer units workspace_options zero",
    "minidl.kernels": "add attention attention_rows batchnorm batchnorm_device bitpack conv "
                      "conv_call conv_device conv_geometry conv_numba conv_ref dropout "
                      "elementwise embedding gelu huffman kmeans layernorm optim pool "
                      "pool_device poolidx precision relative_csr relu rnn rnn_device "
                      "softmax_xent sparse sparse_device sparse_format transformer_device "
                      "weight_record winograd winograd4",
}
OLD_PATHS = sorted(f"{pkg}.{name}" for pkg, names in OLD_FLAT.items() for name in names.split()
                   if f"{pkg}.{name}" not in {f"minidl.{n}" for n in minidl.PUBLIC_SUBMODULES})


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## Where each name lives")
    return text[start:text.index("\n## ", start + 1)]


def documented_modules() -> list[str]:
    """The module table: a package, then its modules, continued on indented lines."""
    table = _section().split("```")[1]
    out, package = [], None
    for line in table.strip("\n").splitlines():
        if not line.startswith(" "):
            package, _, line = line.partition(" ")
        out += [f"{package}.{name}" for name in line.split()]
    return out


def documented_names() -> list[tuple[str, str]]:
    """The public names table: a module, then the names it defines."""
    table = _section().split("```")[3]
    return [(line.split()[0], name) for line in table.strip("\n").splitlines()
            for name in line.split()[1:]]


DOCUMENTED = documented_modules()


def test_the_tables_are_read():
    assert len(DOCUMENTED) > 200 and "minidl.memory.runtime.pool" in DOCUMENTED
    assert ("minidl.train.trainer", "Trainer") in documented_names()


@pytest.mark.parametrize("path", DOCUMENTED)
def test_documented_path_imports(path):
    if path.endswith(".__main__"):  # running it is `python -m minidl`: only its file is checked
        assert importlib.util.find_spec(path) is not None
        return
    module = importlib.import_module(path)
    assert module.__name__ == module.__spec__.name == path


def test_every_package_on_disk_has_a_row():
    packages = {p.rsplit(".", 1)[0] for p in DOCUMENTED}
    for top in (minidl, minidl.memory, minidl.kernels, minidl.layers):
        for init in Path(top.__file__).parent.glob("*/__init__.py"):
            if init.parent.name != "__pycache__":
                assert f"{top.__name__}.{init.parent.name}" in packages


@pytest.mark.parametrize(("module", "name"), documented_names())
def test_public_name_is_defined_where_documented(module, name):
    obj = getattr(importlib.import_module(module), name)
    assert getattr(minidl, name) is obj
    assert getattr(obj, "__module__", module) == module


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_flat_path_is_gone(old):
    assert old not in DOCUMENTED
    with pytest.raises(ModuleNotFoundError, match=re.escape(old)):
        importlib.import_module(old)


def test_no_hook_serves_old_paths():
    for package in (minidl.memory, minidl.kernels):
        assert not hasattr(package, "MOVED_MODULES")
    with pytest.raises(AttributeError):
        minidl.kernels.conv  # noqa: B018
    with pytest.raises(AttributeError):
        minidl.engine  # noqa: B018
    assert not hasattr(minidl, "MOVED_MODULES")


@pytest.mark.parametrize("name", minidl.PUBLIC_SUBMODULES)
def test_public_submodules_import_by_their_short_names(name):
    """``minidl.optim`` and the other public submodules: attributes and import paths, the same
    module objects as their real paths (the README's ``from minidl.optim import SGD``)."""
    module = importlib.import_module(f"minidl.{name}")
    assert module is getattr(minidl, name)
    assert importlib.import_module(module.__name__) is module
