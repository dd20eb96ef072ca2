"""Every training test here runs with the pool's debug mode on: freed blocks are filled with
NaN, so a plan that let any step read a freed tensor would poison losses or gradients and fail
the bit-identity and accuracy checks."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _debug_pool(monkeypatch):
    monkeypatch.setenv("MINIDL_DEBUG_POOL", "1")
