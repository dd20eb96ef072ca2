"""benchmarks/gpu/check.sh, the one prepared command of a session lent a GPU: its plumbing.

Without a GPU every GPU stage is skipped and summary.json says why (exit code 0); on the
strict test device (``CHECK_DEVICE=cuda-strict``, the CPU) every stage runs end to end, so a
broken stage is found here rather than in a GPU session's few minutes; and the summary reads
what the stages left, including a failed test and a timed-out stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "check.sh"


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(out), "PY": sys.executable, "INSTALL": "skip", **env}
    return subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env=full)


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _gpu_present() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 -- no CuPy, or a broken driver: no GPU
        return False


def test_without_a_gpu_every_gpu_stage_is_skipped_and_said(tmp_path):
    if _gpu_present():
        pytest.skip("a GPU is present: the check runs its GPU stages")
    r = _run(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path)
    assert s["gpu"] is False and s["problems"], s
    notes = {st["stage"]: (st["rc"], st["note"]) for st in s["stages"]}
    assert notes["env"][0] == "0"
    for stage in ("smoke", "tests", "peak", "cli", "bench", "swap"):
        assert notes[stage] == ("skipped", "no usable GPU"), notes


def test_the_summary_reads_what_the_stages_left(tmp_path):
    out = tmp_path
    (out / "stages.tsv").write_text("env\t0\t3\t\ntests\t124\t300\ttimed out after 300s\n")
    (out / "env.json").write_text(json.dumps({"gpu_ok": True, "nvvm_ok": True, "problems": [],
                                              "cupy": {"device": "NVIDIA H100", "version": "14"}}))
    (out / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.t" name="a"/>'
        '<testcase classname="tests.gpu.t" name="b"><failure message="boom"/></testcase>'
        '<testcase classname="tests.gpu.t" name="c"><skipped/></testcase>'
        "</testsuite></testsuites>")
    (out / "smoke.json").write_text(json.dumps({"checks": {
        "cupy": {"ok": True}, "launch:x": {"ok": False, "error": "AssertionError: differ"}}}))
    (out / "peak.json").write_text(json.dumps([{"model": "m", "dry_equal": True},
                                               {"model": "n", "dry_equal": False}]))
    (out / "cli_train_a.json").write_text(json.dumps({"peak_allocated_bytes": 110,
                                                      "memory_report": {}}))
    (out / "cli_plan_a.json").write_text(json.dumps({"peak_allocated_bytes": 100}))
    (out / "bench_m.json").write_text(json.dumps({
        "results": [{"step_time_median_s": 0.003, "peak_allocated_bytes": 5}],
        "torch": {"step_time_median_s": 0.002, "time_ratio": 1.5, "device": "cuda"}}))
    subprocess.run([sys.executable, str(CHECK.with_name("summary.py")), str(out)], check=True,
                   capture_output=True)
    s = _summary(out)
    assert s["gpu"] and s["device"] == "NVIDIA H100"
    assert {st["stage"]: st["note"] for st in s["stages"]}["tests"] == "timed out after 300s"
    assert (s["tests"]["passed"], s["tests"]["failed"], s["tests"]["skipped"]) == (1, 1, 1)
    assert s["tests"]["not_passed"][0]["message"] == "boom"
    assert s["smoke"] == {"passed": 1, "failed": {"launch:x": "AssertionError: differ"}}
    assert s["peak_all_equal"] is False
    assert s["cli"]["train_over_plan_peak"]["a"]["ratio"] == pytest.approx(1.1)
    assert s["bench"]["m"]["minidl_over_torch"] == 1.5


@pytest.mark.slow
def test_every_stage_runs_on_the_strict_device(tmp_path):
    """The stages' scripts end to end on the CPU (small sizes), as a GPU session would run
    them: smoke, peak, the CLI pairs and swapping (bench is `minidl bench --device`, tested
    with the CLI)."""
    pytest.importorskip("cupy")
    r = _run(tmp_path, CHECK_DEVICE="cuda-strict", QUICK="1", STAGES="smoke,peak,cli,swap")
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path)
    rcs = {st["stage"]: st["rc"] for st in s["stages"]}
    ran = [k for k in rcs if k not in ("install", "tests", "bench")]
    assert ran and all(rcs[k] == "0" for k in ran), rcs
    assert s["smoke"]["failed"] == {} and s["smoke"]["passed"] >= 5
    assert s["peak_all_equal"], s["peak"]
    assert set(s["cli"]["train_over_plan_peak"]) == {"smallcnn_vdnn", "resnet20_sqrt", "charlstm"}
    assert set(s["swap"]["specs"]) == {"reuse,inplace", "vdnn", "vdnn-all"}


def test_bench_runs_minidl_on_a_device_and_pytorch_beside_it():
    """``minidl bench --device``: minidl's steps on the (here strict) CUDA device, each timed
    until the device has finished; PyTorch in its own process (on the CPU beside the strict
    device, on the GPU beside cuda)."""
    pytest.importorskip("cupy")
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "minidl", "bench", "smallcnn", "--input",
                        "1x12x12", "--batch-size", "4", "--steps", "2", "--memory",
                        "reuse,inplace", "--device", "cuda-strict", "--compare-torch", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["results"][0]["step_time_median_s"] > 0
    assert out["torch"]["device"] == "cpu" and out["torch"]["time_ratio"] > 0
