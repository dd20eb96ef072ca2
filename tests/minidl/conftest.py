"""Every training test here runs with the pool's debug mode on: freed blocks are filled with
NaN, so a plan that let any step read a freed tensor would poison losses or gradients and fail
the bit-identity and accuracy checks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _debug_pool(monkeypatch):
    monkeypatch.setenv("MINIDL_DEBUG_POOL", "1")


@pytest.fixture
def dp_worker():
    """tests/minidl/dp_worker.py (the data-parallel training cases), loaded by path."""
    spec = importlib.util.spec_from_file_location("dp_worker",
                                                  Path(__file__).parent / "dp_worker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
