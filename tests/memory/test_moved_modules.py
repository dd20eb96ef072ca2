"""Part 20 moved the flat modules of memory and minidl into sub-packages; old paths import."""

import importlib
from unittest import mock

import pytest

import minidl
import minidl.memory as memory
from minidl.memory import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"minidl.memory.{MOVED_MODULES[old]}.{old}")
    assert importlib.import_module(f"minidl.memory.{old}") is new
    assert getattr(memory, old) is new
    assert new.__spec__.name == new.__name__ == f"minidl.memory.{MOVED_MODULES[old]}.{old}"


def test_from_import_and_patch_reach_the_same_module():
    from minidl.memory import pool
    from minidl.memory.runtime import pool as moved

    assert pool is moved
    with mock.patch("minidl.memory.pool.Pool") as fake:
        assert moved.Pool is fake


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        memory.nonesuch  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("minidl.memory.nonesuch")


@pytest.mark.parametrize("old", sorted(minidl.MOVED_MODULES))
def test_minidl_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"minidl.{minidl.MOVED_MODULES[old]}.{old}")
    assert importlib.import_module(f"minidl.{old}") is new
    assert getattr(minidl, old) is new


def test_minidl_public_names_where_the_readme_shows_them():
    from minidl.models import get_model
    from minidl.optim import SGD
    from minidl.trainer import Trainer

    assert Trainer is minidl.Trainer and SGD is minidl.optim.SGD
    assert get_model is minidl.zoo.models.get_model


@pytest.mark.parametrize("old", sorted(minidl.kernels.MOVED_MODULES))
def test_kernels_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"minidl.kernels.{minidl.kernels.MOVED_MODULES[old]}.{old}")
    assert importlib.import_module(f"minidl.kernels.{old}") is new
    assert getattr(minidl.kernels, old) is new
