"""The benchmark scripts time PyTorch in a process of its own, never in minidl's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SPEED = BENCHMARKS / "speed"  # the scripts that time PyTorch, and their separate_processes.py
GATES = BENCHMARKS / "gates"

# the script's main() in this process, then whether torch was ever imported here
RUN_MAIN = r"""
import sys
sys.path.insert(0, {bench!r})
import {module}
{module}.main({argv!r})
print("torch in parent:", "torch" in sys.modules)
"""


def _run_main(module: str, argv: list[str]) -> str:
    code = RUN_MAIN.format(bench=str(SPEED), module=module, argv=argv)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_conv_bench_times_torch_in_its_own_process():
    pytest.importorskip("torch")
    out = _run_main("conv_bench", ["--rounds", "2", "--block", "1", "--warmup", "0",
                                   "--batch-size", "2"])
    assert "torch in parent: False" in out
    assert "(in a process of its own)" in out
    assert "ratio minidl/torch" in out
    diff = float(out.split("max relative gradient difference ")[1].split()[0])
    assert diff < 1e-4
    table = out.split("per layer (median ms):")[1].splitlines()[1:]
    conv1_fwd = next(line for line in table if line.split()[0] == "conv1.fwd").split()
    assert float(conv1_fwd[1]) > 0 and float(conv1_fwd[2]) > 0  # both sides timed


@pytest.mark.slow
def test_rnn_bench_times_torch_in_its_own_process():
    pytest.importorskip("torch")
    out = _run_main("rnn_bench", ["--rounds", "2", "--block", "1", "--batch-size", "2",
                                  "--seq-len", "3"])
    assert "torch in parent: False" in out
    assert "(in a process of its own)" in out
    losses = out.split("losses ")[1].split(";")[0].split(" / ")
    assert float(losses[0]) == pytest.approx(float(losses[1]), rel=1e-5)
    assert "ratio minidl/torch" in out
    assert "torch parts (median ms): embedding.fwd" in out


def test_child_process_runs_methods_elsewhere_and_reports_their_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(SPEED))  # the child imports the module too
    from separate_processes import ChildProcess

    with ChildProcess(dict, {"pid": 0}) as child:
        assert child.call("get", "pid") == 0
        assert child.call("__len__") == 1
        with pytest.raises(RuntimeError, match="(?s)in the child process:.*KeyError"):
            child.call("__getitem__", "missing")
        assert child.call("setdefault", "pid", 1) == 0  # still serving after an error
    with ChildProcess(__import__, "os") as child:  # the child's os module
        assert child.call("getpid") != os.getpid()
    with pytest.raises(RuntimeError, match="(?s)in the child process:.*ZeroDivisionError"):
        ChildProcess(divmod, 1, 0)


def test_ab_setting_finds_module_constants_and_class_attributes():
    sys.path.insert(0, str(GATES))
    try:
        import ab_setting
    finally:
        sys.path.remove(str(GATES))
    from minidl.kernels.convolution import conv_geometry
    from minidl.layers.recurrent import units

    assert ab_setting._owner("minidl.kernels.convolution.conv_geometry.GEMM_MIN_COLS") == (
        conv_geometry, "GEMM_MIN_COLS")
    assert ab_setting._owner(
        "minidl.layers.recurrent.units._UnitOps.edge_projection_steps") == (
        units._UnitOps, "edge_projection_steps")
    with pytest.raises(SystemExit, match="no setting"):
        ab_setting._owner("minidl.kernels.convolution.conv_geometry.NO_SUCH_CONSTANT")


def _has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@pytest.mark.skipif(not _has_avx2_fma(), reason="the panel kernel needs AVX2 and FMA")
@pytest.mark.parametrize("block", [16, 5])
def test_recurrent_product_panels_compute_the_products(block):
    """The experiment's own kernel computes what BLAS does (64 gate rows: 10 whole panels and
    4 plain rows; 16 batch rows: 2 panels and 4 plain rows), blocked or not over k."""
    sys.path.insert(0, str(SPEED))
    try:
        import numpy as np
        import recurrent_product
    finally:
        sys.path.remove(str(SPEED))
    rng = np.random.default_rng(1)
    n, hid = 16, 16
    w = rng.standard_normal((4 * hid, hid)).astype(np.float32)
    h = rng.standard_normal((n, hid)).astype(np.float32)
    out = np.full((4 * hid, n), np.nan, np.float32)
    recurrent_product.panel_forward(w, np.ascontiguousarray(h.T), out, block)
    exact = w.astype(np.float64) @ h.T.astype(np.float64)
    assert np.abs(out - exact).max() <= 1e-5 * np.abs(exact).max()
    dg = rng.standard_normal((n, 4 * hid)).astype(np.float32)
    carry = np.full((n, hid), np.nan, np.float32)
    recurrent_product.panel_backward(dg, w, carry)
    exact = dg.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(carry - exact).max() <= 1e-5 * np.abs(exact).max()
