"""Options, not environment: the environment is read in minidl/settings.py only, as defaults."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.kernels import parallel
from minidl.optim import SGD
from minidl.settings import Settings
from minidl.zoo.models import smallcnn

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _reads_environment(path: pathlib.Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names):
            return True
    return False


def test_environment_read_in_one_place():
    readers = sorted(str(p.relative_to(ROOT)) for pkg in ("minidl", "memory", "kernels", "layers")
                     for p in (ROOT / pkg).rglob("*.py") if _reads_environment(p))
    assert readers == ["minidl/settings.py"]


def test_settings_from_environment():
    assert Settings.from_environment({}) == Settings(False, None, 1)
    env = {"MINIDL_DEBUG_POOL": "1", "MINIDL_NUM_THREADS": "3", "MINIDL_BLAS_THREADS": "2"}
    assert Settings.from_environment(env) == Settings(True, 3, 2)
    assert not Settings.from_environment({"MINIDL_DEBUG_POOL": "0"}).debug_pool
    with pytest.raises(ValueError, match="MINIDL_NUM_THREADS"):
        Settings.from_environment({"MINIDL_NUM_THREADS": "zero"})
    with pytest.raises(ValueError, match="MINIDL_BLAS_THREADS"):
        Settings.from_environment({"MINIDL_BLAS_THREADS": "0"})


def test_kernels_take_the_thread_count_they_are_given(monkeypatch):
    before = parallel.num_threads()
    monkeypatch.setenv("MINIDL_NUM_THREADS", str(before + 5))
    assert parallel.num_threads() == before  # the kernels never read the environment
    try:
        parallel.set_thread_policy(3, parallel.num_blas_threads())
        assert parallel.num_threads() == 3
        with pytest.raises(ValueError):
            parallel.set_thread_policy(0)
    finally:
        parallel.set_thread_policy(None, 1)


def test_environment_applied_by_a_trainer_not_at_import():
    """Importing minidl leaves the process's thread counts alone; a Trainer applies
    MINIDL_NUM_THREADS / MINIDL_BLAS_THREADS (OPENBLAS_THREAD_TIMEOUT is set at import: it
    only counts before NumPy loads)."""
    env = dict(os.environ, MINIDL_NUM_THREADS="1", MINIDL_BLAS_THREADS="2")
    env.pop("OPENBLAS_THREAD_TIMEOUT", None)
    code = ("import os, minidl; from minidl.kernels import parallel; "
            "print(parallel.num_blas_threads(), os.environ['OPENBLAS_THREAD_TIMEOUT']); "
            "from minidl.zoo.models import smallcnn; "
            "minidl.Trainer(smallcnn((1, 8, 8), 10, width=4), device_memory='16MiB'); "
            "print(parallel.num_threads(), parallel.num_blas_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out == ["1", "22", "1", "2"]


def test_trainer_debug_and_threads_are_options(monkeypatch):
    net = smallcnn((1, 8, 8), 10, width=4)
    monkeypatch.setenv("MINIDL_DEBUG_POOL", "1")
    assert minidl.Trainer(net, device_memory="16MiB").pool.debug  # the default: environment
    assert not minidl.Trainer(net, device_memory="16MiB", debug=False).pool.debug
    monkeypatch.delenv("MINIDL_DEBUG_POOL")
    assert not minidl.Trainer(net, device_memory="16MiB").pool.debug
    assert minidl.Trainer(net, device_memory="16MiB", debug=True).pool.debug
    try:
        tr = minidl.Trainer(net, device_memory="16MiB", threads=1)
        assert parallel.num_threads() == 1
        x = np.zeros((2, 1, 8, 8), np.float32)
        assert np.isfinite(tr.step(x, np.zeros(2, np.int64)))
    finally:
        parallel.set_thread_policy(None, 1)


def test_cuda_disk_cache_from_the_environment_applied_by_a_trainer(monkeypatch):
    """MINIDL_CUDA_CACHE=1 is read by Settings only and applied when a trainer is made; the
    kernels then ask Numba for its disk cache (not under the simulator, which has none)."""
    from minidl.kernels import _cuda

    assert Settings.from_environment({"MINIDL_CUDA_CACHE": "1"}).cuda_disk_cache
    assert not Settings.from_environment({}).cuda_disk_cache
    monkeypatch.setattr(_cuda, "simulator", lambda: False)
    monkeypatch.setenv("MINIDL_CUDA_CACHE", "1")
    try:
        net = minidl.Sequential([L.Linear(2, 2)], input_shape=(2,))
        minidl.Trainer(net, SGD(net.parameters(), lr=0.1))
        assert _cuda.disk_cache_options() == {"cache": True}
    finally:
        _cuda.set_disk_cache(False)
    assert _cuda.disk_cache_options() == {}
