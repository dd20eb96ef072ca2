"""The GPU check's parts that a card is not needed to see wrong: the test-log parser the
summary falls back on (pytest-xdist's lines), the copy engine's link rate (from copies that
have completed, on a fake CuPy), smoke.py's link figures, the ``h200`` target and the swap
stage's choice of profile by the GPU's name."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from minidl.memory.cost.targets import PROFILES, get_target
from minidl.memory.devices.cuda_streams import CudaCopyEngine

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_gpucheck_{name}", GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------- test logs
XDIST_LOG = """\
============================= test session starts ==============================
created: 4/4 workers
4 workers [6 items]

[gw1] [ 16%] PASSED tests/memory/devices/test_cuda_device.py::test_views
[gw0] [ 33%] FAILED tests/gpu/test_cuda_training.py::test_step[resnet8-vdnn]
[gw2] [ 50%] SKIPPED tests/gpu/test_nccl_comm.py::test_allreduce
[gw3] [ 66%] ERROR tests/minidl/compile/test_gpu_step.py::test_outside_arena
[gw1] [ 83%] PASSED tests/gpu/test_cuda_training.py::test_step[smallcnn-reuse,inplace]
=========================== short test summary info ============================
PASSED tests/memory/devices/test_cuda_device.py::test_views
FAILED tests/gpu/test_cuda_training.py::test_step[resnet8-vdnn] - AssertionError: loss
"""


def test_the_log_parser_reads_xdist_and_plain_lines():
    summary = _module("summary")
    assert summary.outcome("[gw0] [ 12%] PASSED tests/a/test_x.py::test_y") == (
        "tests/a/test_x.py::test_y", "PASSED")
    assert summary.outcome("tests/a/test_x.py::test_y[1-2] FAILED   [ 50%]") == (
        "tests/a/test_x.py::test_y[1-2]", "FAILED")
    assert summary.outcome("FAILED tests/a/test_x.py::t - AssertionError: x") == (
        "tests/a/test_x.py::t", "FAILED")
    assert summary.outcome("[gw0] [ 12%] PASSED") is None
    assert summary.outcome("collected 7 items / 4 workers") is None


def test_a_suite_killed_before_its_xml_is_counted_from_its_xdist_log(tmp_path):
    (tmp_path / "stages.tsv").write_text("tests\t124\t200\ttimed out after 200s\n")
    (tmp_path / "tests.log").write_text(XDIST_LOG)
    subprocess.run([sys.executable, str(GPU / "summary.py"), str(tmp_path)], check=True,
                   capture_output=True)
    tests = json.loads((tmp_path / "summary.json").read_text())["tests"]
    assert tests["from_log_only"] is True
    assert (tests["passed"], tests["failed"], tests["skipped"], tests["error"]) == (2, 1, 1, 1)
    assert set(tests["not_passed"]) == {"tests/gpu/test_cuda_training.py::test_step[resnet8-vdnn]",
                                        "tests/minidl/compile/test_gpu_step.py::test_outside_arena"}


# ----------------------------------------------------------------------------- link rate
class _Clock:
    """The fake GPU's time: each stream's work ends at its own clock; ``now`` is how far the
    device has got."""

    now = 0.0


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.clock = 0.0

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        _Clock.now = max(_Clock.now, self.clock)


_COMPUTE = _Stream()


class _Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self.t = None

    def record(self, stream=None) -> None:
        self.t = (stream or _COMPUTE).clock

    @property
    def done(self) -> bool:
        return self.t <= _Clock.now

    def synchronize(self) -> None:
        _Clock.now = max(_Clock.now, self.t)


RATE = 10e9  # the fake link: bytes per second


class _Data:
    def _copy(self, nbytes: int, stream: _Stream) -> None:
        stream.clock += nbytes / RATE

    def copy_from_host_async(self, ptr, nbytes, stream) -> None:
        self._copy(nbytes, stream)

    def copy_to_host_async(self, ptr, nbytes, stream) -> None:
        self._copy(nbytes, stream)

    def copy_from_device_async(self, src, nbytes, stream) -> None:
        self._copy(nbytes, stream)


class _DeviceArray:
    def __init__(self, nbytes: int) -> None:
        self.shape, self.dtype, self.nbytes = (nbytes,), "uint8", nbytes
        self.flags = SimpleNamespace(c_contiguous=True)
        self.data = _Data()


class _HostArray(_DeviceArray):
    ctypes = SimpleNamespace(data=0)


class _Device:
    def __init__(self, i: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


FAKE_CUPY = SimpleNamespace(ndarray=_DeviceArray, cuda=SimpleNamespace(
    Device=_Device, Stream=_Stream, Event=_Event, get_current_stream=lambda: _COMPUTE,
    get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3))


@pytest.fixture
def engine():
    _Clock.now = 0.0
    return CudaCopyEngine(FAKE_CUPY, 0)


def test_the_link_rate_counts_only_copies_that_have_completed(engine):
    up = engine.copy_async(_DeviceArray(4_000_000), _HostArray(4_000_000))  # 0.4 ms
    down = engine.copy_async(_HostArray(8_000_000), _DeviceArray(8_000_000))  # 0.8 ms
    _Clock.now = 0.5e-3  # the upload has finished, the download not
    assert engine.retired() == (4_000_000, pytest.approx(0.4e-3))
    assert engine.link_rate() == pytest.approx(RATE)
    assert engine.total_bytes == 12_000_000  # (queued: over busy_s it would read 3x the rate)
    down.wait()  # the copy completes, but waiting does not count it in busy_s
    assert up.done() and engine.busy_s == pytest.approx(0.4e-3)
    assert engine.link_rate() == pytest.approx(RATE)  # retires it first
    assert engine.retired() == (12_000_000, pytest.approx(1.2e-3))


def test_smoke_reads_the_link_rate_of_retired_copies(engine):
    smoke = _module("smoke")
    engine.copy_async(_HostArray(6_000_000), _DeviceArray(6_000_000))
    engine.copy_async(_DeviceArray(2_000_000), _HostArray(2_000_000)).wait()
    got = smoke.link_figures(engine)
    assert got["copied_bytes"] == 8_000_000
    assert got["copy_engine_busy_s"] == pytest.approx(0.8e-3)
    assert got["link_GBps"] == pytest.approx(RATE / 1e9)


# ----------------------------------------------------------------------------- targets
def test_the_h200_profile_has_its_datasheet_figures():
    h200, h100 = get_target("H200"), PROFILES["h100"]
    assert h200 is PROFILES["h200"]
    assert h200.hbm_bytes_per_s == 4.8e12 and h200.capacity_bytes == 141 << 30
    assert h200.flops_per_s == h100.flops_per_s == 67e12  # same Hopper die, FP32
    assert h200.link_h2d_bytes_per_s == h100.link_h2d_bytes_per_s  # PCIe 5.0 x16
    assert "H200" in h200.source


def test_the_swap_stage_predicts_for_the_card_it_runs_on():
    swap = _module("swap")
    assert swap.target_for("NVIDIA H200") == "h200"
    assert swap.target_for("NVIDIA H100 80GB HBM3") == "h100"
    assert swap.target_for("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert swap.target_for("Tesla V100-SXM2-16GB") == "v100"
    assert swap.target_for(None) == "h100"
