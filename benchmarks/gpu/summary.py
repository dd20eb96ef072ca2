"""summary.json of a check.sh run: every stage's outcome (rc, seconds, its figures) and the
figures the project's targets are read from, from whatever the stages have left so far.

    summary.py RUN            -> RUN/summary.json
    summary.py RUN OUT        -> OUT/summary.json, OUT/junit.xml (every junit*.xml of RUN in
                                 one), OUT/gpu_check_files.tar.gz (all of RUN: logs, per-run
                                 files), each written to a .tmp and renamed, under a lock

check.sh calls the second form first, after every stage and every PACK_EVERY_S meanwhile, so
a check killed at any point leaves a valid summary and archive; the three files, with
check.log, are what comes back from a machine that returns at most 8 files of 16 MiB.
"""

from __future__ import annotations

import fcntl
import glob
import io
import json
import os
import re
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from typing import Any

OUT = sys.argv[1] if len(sys.argv) > 1 else "."  # (the RUN folder the stages write to)
ARCHIVE = "gpu_check_files.tar.gz"
#: A returned file's size limit, less a margin: a larger file is cut to its head and tail.
MAX_FILE_BYTES = 15 << 20
#: The GPU suite's parts: (JUnit XML, its log); the memory-measuring part runs alone first.
TEST_PARTS = (("junit_alone.xml", "tests_alone.log"), ("junit.xml", "tests.log"))


def load(name: str) -> Any:
    try:
        with open(os.path.join(OUT, name)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"missing": f"{name}: {type(e).__name__}"}


def stages() -> list[dict]:
    rows = []
    try:
        lines = open(os.path.join(OUT, "stages.tsv")).read().splitlines()
    except OSError:
        return rows
    for line in lines:
        p = line.split("\t")
        if len(p) >= 3:
            rows.append({"stage": p[0], "rc": p[1], "seconds": p[2],
                         "note": p[3] if len(p) > 3 else ""})
    return rows


_STATUS = "PASSED|FAILED|ERROR|SKIPPED"
_NODE = r"tests/\S+?::\S+"
_AFTER = re.compile(rf"^(?:\[gw\d+\]\s+)?({_NODE})\s+({_STATUS})\b")
_BEFORE = re.compile(rf"^(?:\[gw\d+\]\s+)?(?:\[\s*\d+%\]\s+)?({_STATUS})\s+({_NODE})(?:\s|$)")


def outcome(line: str) -> tuple[str, str] | None:
    """``(test id, PASSED | FAILED | ERROR | SKIPPED)`` of one line of pytest's output."""
    line = line.strip()
    m = _AFTER.match(line)
    if m:
        return m.group(1), m.group(2)
    m = _BEFORE.match(line)
    if m:
        return m.group(2), m.group(1)
    return None


def from_log(name: str) -> dict:
    """Test outcomes from pytest's -v lines, when the run died before writing its XML: a
    plain run's ``tests/x.py::t PASSED [ 12%]`` and pytest-xdist's
    ``[gw0] [ 12%] PASSED tests/x.py::t`` (and ``-rA``'s ``FAILED tests/x.py::t - why``)."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad, seen = [], set()
    try:
        lines = open(os.path.join(OUT, name), errors="replace").read().splitlines()
    except OSError:
        return {"missing": name}
    for line in lines:
        hit = outcome(line)
        if hit and hit not in seen:
            seen.add(hit)
            counts[hit[1].lower()] += 1
            if hit[1] in ("FAILED", "ERROR"):
                bad.append(hit[0])
    return {"from_log_only": True, **counts, "not_passed": bad[:80]}


def junit(name: str, log: str) -> dict:
    path = os.path.join(OUT, name)
    if not os.path.exists(path):
        return from_log(log)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"unreadable": str(e)}
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad = []
    for tc in root.iter("testcase"):
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), None)
        counts["passed" if kind is None else "failed" if kind == "failure" else kind] += 1
        if kind in ("failure", "error"):
            el = next(c for c in tc if c.tag == kind)
            bad.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "kind": kind,
                        "message": (el.get("message") or "")[:300]})
    return {**counts, "not_passed": bad[:80]}


def cli_pairs() -> dict:
    runs: dict = {}
    for path in sorted(glob.glob(os.path.join(OUT, "cli_*.json"))):
        name = os.path.basename(path)[4:-5]
        d = load(os.path.basename(path))
        if "missing" in d:
            runs[name] = {"error": f"no JSON (see cli_{name}.err)"}
            continue
        keep = ("peak_allocated_bytes", "peak_reserved_bytes", "final_loss", "steps",
                "step_time_median_s")
        runs[name] = {k: d.get(k) for k in keep if k in d}
        rep = d.get("memory_report", {})
        for key in ("outside_arena", "device_temporaries", "swap", "capacity_bytes"):
            if key in rep:
                runs[name][key] = rep[key]
    pairs = {}
    for name, d in runs.items():
        other = runs.get("plan_" + name[6:]) if name.startswith("train_") else None
        if other and d.get("peak_allocated_bytes") and other.get("peak_allocated_bytes"):
            pairs[name[6:]] = {"train": d["peak_allocated_bytes"],
                               "plan": other["peak_allocated_bytes"],
                               "ratio": d["peak_allocated_bytes"] / other["peak_allocated_bytes"]}
    return {"runs": runs, "train_over_plan_peak": pairs}


def bench() -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(OUT, "bench_*.json"))):
        name = os.path.basename(path)[6:-5]
        d = load(os.path.basename(path))
        if "results" not in d:
            out[name] = {"error": f"no result (see bench_{name}.err)"}
            continue
        r = d["results"][0]
        out[name] = {"minidl_step_ms": 1000 * r["step_time_median_s"],
                     "peak_allocated_bytes": r["peak_allocated_bytes"]}
        if "torch" in d:
            out[name]["torch_step_ms"] = 1000 * d["torch"]["step_time_median_s"]
            out[name]["minidl_over_torch"] = d["torch"]["time_ratio"]
    return out


def tests_summary() -> dict:
    """The GPU suite's outcome: each part from its JUnit XML, or from its log where the part
    was killed before writing one; counts over the parts that ran."""
    parts = {}
    for xml, log in TEST_PARTS:
        if os.path.exists(os.path.join(OUT, xml)) or os.path.exists(os.path.join(OUT, log)):
            parts[log[:-4]] = junit(xml, log)
    total: dict = {k: sum(p.get(k, 0) for p in parts.values())
                   for k in ("passed", "failed", "error", "skipped")}
    total["not_passed"] = [b for p in parts.values() for b in p.get("not_passed", [])][:80]
    if any(p.get("from_log_only") for p in parts.values()):
        total["from_log_only"] = True
    return {**total, "parts": {k: {n: v for n, v in p.items() if n != "not_passed"}
                               for k, p in parts.items()}}


def running() -> dict | None:
    """The stage under way (check.sh's current.tsv: name, start time), if any."""
    try:
        name, since = open(os.path.join(OUT, "current.tsv")).read().split("\t")[:2]
        return {"stage": name, "for_s": int(time.time()) - int(since)}
    except (OSError, ValueError):
        return None


def stage_figures(name: str, s: dict) -> Any:
    """The figures of one stage, from the summary's sections."""
    if name.startswith("env"):
        return {"gpu": s["gpu"], "nvvm": s["nvvm"]["ok"], "problems": s["problems"]}
    if name == "smoke":
        return {"passed": s["smoke"]["passed"], "failed": sorted(s["smoke"]["failed"])}
    if name.startswith("tests"):
        return s["tests"]["parts"].get(name)
    if name == "peak":
        return {"cases": len(s["peak"]), "all_equal": s["peak_all_equal"],
                "not_equal": [f"{r.get('model')} {r.get('spec')}" for r in s["peak"]
                              if not r.get("dry_equal")]}
    if name.startswith("bench_"):
        return s["bench"].get(name[6:])
    if name.startswith("cli_"):
        return s["cli"]["runs"].get(name[4:])
    if name == "swap" and isinstance(s["swap"].get("specs"), dict):
        keep = ("measured_step_s", "measured_over_predicted_step", "measured_overhead",
                "link_GBps", "error")
        return {spec: {k: r.get(k) for k in keep if k in r}
                for spec, r in s["swap"]["specs"].items()}
    return None


def build() -> dict:
    env = load("env.json")
    smoke = load("smoke.json").get("checks", {})
    peak = load("peak.json")
    peak_rows = peak if isinstance(peak, list) else []
    cupy = env.get("cupy") if isinstance(env.get("cupy"), dict) else {}
    numba = env.get("numba") if isinstance(env.get("numba"), dict) else {}
    summary = {
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": (int(time.time()) - int(os.environ["GPUCHECK_START"])
                      if os.environ.get("GPUCHECK_START") else None),
        "running": running(),
        "gpu": bool(env.get("gpu_ok")),
        "nvvm": {"ok": bool(env.get("nvvm_ok")), **load("nvvm.json"),
                 "loaded_from": numba.get("nvvm_loaded_from")},
        "problems": env.get("problems", []),
        "device": cupy.get("device"),
        "versions": {k: env.get(k) for k in ("python", "minidl")} | {
            "cupy": cupy.get("version"), "driver": cupy.get("driver_version"),
            "numba": env.get("numba"), "torch": env.get("torch")},
        "stages": stages(),
        "smoke": {"passed": sum(1 for v in smoke.values() if v.get("ok")),
                  "failed": {k: v.get("error") for k, v in smoke.items() if not v.get("ok")},
                  "device": (smoke.get("device") or {}).get("value")},
        "tests": tests_summary(),
        "peak": [{k: v for k, v in r.items() if k != "traceback"} for r in peak_rows],
        "peak_all_equal": bool(peak_rows) and all(r.get("dry_equal") for r in peak_rows),
        "cli": cli_pairs(),
        "bench": bench(),
        "swap": load("swap.json"),
    }
    for row in summary["stages"]:
        row["figures"] = None if row["rc"] == "skipped" else stage_figures(row["stage"], summary)
    return summary


def _replace(path: str, data: bytes) -> None:
    """``data`` into ``path`` by way of ``path.tmp`` and a rename (never half a file)."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _capped(path: str) -> bytes:
    """A file's bytes, cut to its head and tail around a note when over MAX_FILE_BYTES / 2."""
    half = MAX_FILE_BYTES // 4
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= 2 * half:
            return f.read()
        head = f.read(half)
        f.seek(size - half)
        return head + f"\n[... {size - 2 * half} bytes cut ...]\n".encode() + f.read()


def archive() -> bytes:
    """Every file under RUN (two folders down at most), compressed; cut files so the archive
    stays under MAX_FILE_BYTES."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for root, dirs, files in os.walk(OUT):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                if name.endswith((".lock", ".tmp")) or not os.path.isfile(path):
                    continue
                try:
                    data = _capped(path)
                except OSError:
                    continue
                info = tarfile.TarInfo(os.path.join("gpu_check", os.path.relpath(path, OUT)))
                info.size, info.mtime = len(data), int(os.path.getmtime(path))
                tar.addfile(info, io.BytesIO(data))
                if buf.tell() > MAX_FILE_BYTES:
                    break
    return buf.getvalue()


def merged_junit() -> bytes | None:
    """Every part's JUnit XML as one ``<testsuites>`` (None before any was written)."""
    root = ET.Element("testsuites")
    for xml, _ in TEST_PARTS:
        try:
            part = ET.parse(os.path.join(OUT, xml)).getroot()
        except (OSError, ET.ParseError):
            continue
        for suite in ([part] if part.tag == "testsuite" else list(part)):
            suite.set("name", f"{suite.get('name', 'pytest')}:{xml[:-4]}")
            root.append(suite)
    if not len(root):
        return None
    data = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data if len(data) <= MAX_FILE_BYTES else None


def main() -> None:
    dest = sys.argv[2] if len(sys.argv) > 2 else None
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, ".pack.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (check.sh's periodic call and a stage's end)
        summary = build()
        if dest is None:
            _replace(os.path.join(OUT, "summary.json"),
                     json.dumps(summary, indent=1, default=str).encode())
        else:
            os.makedirs(dest, exist_ok=True)
            data = archive()
            summary["archive"] = {"name": ARCHIVE, "bytes": len(data)}
            _replace(os.path.join(dest, "summary.json"),
                     json.dumps(summary, indent=1, default=str).encode())
            junit_xml = merged_junit()
            if junit_xml is not None:
                _replace(os.path.join(dest, "junit.xml"), junit_xml)
            _replace(os.path.join(dest, ARCHIVE), data)
    print(json.dumps({k: summary[k] for k in ("gpu", "problems", "smoke", "peak_all_equal",
                                              "bench")}, default=str)[:3000])
    print(json.dumps({"tests": {k: v for k, v in summary["tests"].items()
                                if k != "not_passed"}}, default=str))


if __name__ == "__main__":
    main()
