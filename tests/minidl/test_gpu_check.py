"""benchmarks/gpu/check.sh, the one prepared command of a session lent a GPU: its plumbing.

Without a GPU every GPU stage is skipped and summary.json says why (exit code 0); on the
strict test device (``CHECK_DEVICE=cuda-strict``, the CPU) every stage runs end to end, so a
broken stage is found here rather than in a GPU session's few minutes; and the summary reads
what the stages left, including a failed test and a timed-out stage. Either way, what it
leaves in $OUT is what a device machine returns whole (at most 8 files of under 16 MiB, plain
names, no deeper than 2 folders), also when the check is killed halfway.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "check.sh"


def _env(out: Path, **env: str) -> dict:
    return {**os.environ, "OUT": str(out), "PY": sys.executable, "INSTALL": "skip", **env}


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=900,
                          cwd=REPO, env=_env(out, **env))


def _returnable(out: Path) -> dict[str, Path]:
    """The files under ``out``, asserting a device machine returns every one of them (its
    limits: 8 files, 16 MiB each, names of letters, digits, '.', '_', '-', 2 folders down)."""
    files = {}
    for path in out.rglob("*"):
        rel = path.relative_to(out)
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        if path.is_file():
            assert len(rel.parts) <= 3 and path.stat().st_size < 16 << 20, rel
            files[str(rel)] = path
    assert len(files) <= 8, sorted(files)
    return files


def _archived(out: Path) -> set[str]:
    with tarfile.open(out / "gpu_check_files.tar.gz") as tar:
        return {Path(m.name).name for m in tar.getmembers()}


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
    assert set(_returnable(tmp_path)) == {"summary.json", "check.log", "gpu_check_files.tar.gz"}
    assert {"env.json", "env.log", "stages.tsv", "nvvm.json", "pip-freeze.txt",
            "nvidia-smi.txt"} <= _archived(tmp_path)
    assert s["archive"]["name"] == "gpu_check_files.tar.gz" and s["running"] is None


def test_nvvm_is_taken_from_the_toolkit_beside_nvcc(tmp_path):
    """No CUDA_HOME: the toolkit of the nvcc on PATH (bin/..) holds nvvm/lib64/libnvvm.so,
    which the check uses (CUDA_HOME, LD_LIBRARY_PATH) and names in the summary."""
    if _gpu_present():
        pytest.skip("a GPU is present: a fake toolkit would be used for real")
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "nvvm" / "lib64").mkdir(parents=True)
    (toolkit / "nvvm" / "lib64" / "libnvvm.so.4").write_bytes(b"")
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\necho fake nvcc\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, timeout=300,
                       cwd=REPO, env={**_env(out), "CUDA_HOME": "", "CUDA_PATH": "",
                                      "PATH": f"{toolkit / 'bin'}:{env['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    nvvm = _summary(out)["nvvm"]
    assert nvvm["source"] == "toolkit" and nvvm["cuda_home"] == str(toolkit), nvvm
    assert nvvm["detail"].endswith("nvvm/lib64/libnvvm.so.4")
    _returnable(out)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def test_a_check_killed_mid_stage_leaves_a_valid_summary_and_archive(tmp_path):
    """SIGKILL (a device call's time limit) while the smoke stage runs: summary.json, rewritten
    every second meanwhile (PACK_EVERY_S=1), still parses and says which stage was running."""
    pytest.importorskip("cupy")
    work = tmp_path / "tmp"  # (its work folder, which a kill leaves behind)
    work.mkdir()
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(CHECK)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=REPO,
                            env=_env(out, CHECK_DEVICE="cuda-strict", QUICK="1",
                                     STAGES="smoke", PACK_EVERY_S="1", TMPDIR=str(work)))
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if (_summary(out).get("running") or {}).get("stage") == "smoke":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the smoke stage was never seen running")
    finally:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(30)
    time.sleep(0.2)
    _returnable(out)
    s = _summary(out)
    assert s["running"]["stage"] == "smoke"
    assert {st["stage"]: st["rc"] for st in s["stages"]}["env"] == "0"
    assert {"env.json", "stages.tsv"} <= _archived(out)


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
    assert s["smoke"] == {"passed": 1, "failed": {"launch:x": "AssertionError: differ"},
                          "device": None}
    assert s["peak_all_equal"] is False
    assert s["cli"]["train_over_plan_peak"]["a"]["ratio"] == pytest.approx(1.1)
    assert s["bench"]["m"]["minidl_over_torch"] == 1.5


@pytest.mark.slow
def test_every_stage_runs_on_the_strict_device(tmp_path):
    """The stages' scripts end to end on the CPU (small sizes), as a GPU session would run
    them: smoke, peak, the CLI pairs and swapping (bench is `minidl bench --device`, tested
    with the CLI)."""
    pytest.importorskip("cupy")
    r = _run(tmp_path, CHECK_DEVICE="cuda-strict", QUICK="1", STAGES="smoke,peak,cli,swap,tests",
             SUITE="tests/gpu", TEST_WORKERS="2", GPUCHECK_WORKERS="2")
    assert r.returncode == 0, r.stdout + r.stderr
    s = _summary(tmp_path)
    rcs = {st["stage"]: st["rc"] for st in s["stages"]}
    ran = [k for k in rcs if k not in ("install", "bench")]
    assert ran and all(rcs[k] == "0" for k in ran), rcs
    assert s["smoke"]["failed"] == {} and s["smoke"]["passed"] >= 5
    assert s["peak_all_equal"], s["peak"]
    assert set(s["cli"]["train_over_plan_peak"]) == {"smallcnn_vdnn", "resnet20_sqrt", "charlstm",
                                                     "smallcnn_bf16"}
    assert set(s["swap"]["specs"]) == {"reuse,inplace", "vdnn", "vdnn-all"}
    figures = {st["stage"]: st["figures"] for st in s["stages"]}
    assert figures["smoke"]["passed"] == s["smoke"]["passed"] and figures["peak"]["all_equal"]
    assert set(s["tests"]["parts"]) == {"tests_alone", "tests"}  # (skipped without a GPU)
    assert s["tests"]["skipped"] > 0 and not s["tests"].get("from_log_only")
    files = _returnable(tmp_path)
    assert set(files) == {"summary.json", "check.log", "junit.xml", "gpu_check_files.tar.gz"}
    assert {"smoke.json", "peak.json", "swap.json", "cli_train_charlstm.json",
            "cli_plan_charlstm.err", "tests.log", "junit_alone.xml"} <= _archived(tmp_path)


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
