"""Shared pytest setup: the ``gpu`` marker is skipped where CUDA is not available."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import cupy  # noqa: F401

        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA device (cupy.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
