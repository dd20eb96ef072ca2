"""summary.json of a check.sh run (argv[1]: its OUT folder): every stage's outcome and the
figures the project's targets are read from. Runs at the end of the check and on any exit, so
it reads whatever the stages left."""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

OUT = sys.argv[1] if len(sys.argv) > 1 else "."


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


def from_log(name: str) -> dict:
    """Test outcomes from pytest's -v lines, when the run died before writing its XML."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad, seen = [], set()
    try:
        lines = open(os.path.join(OUT, name), errors="replace").read().splitlines()
    except OSError:
        return {"missing": name}
    pat = re.compile(r"(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)")
    for line in lines:
        m = pat.search(line)
        if m and (m.group(1), m.group(2)) not in seen:
            seen.add((m.group(1), m.group(2)))
            counts[m.group(2).lower()] += 1
            if m.group(2) in ("FAILED", "ERROR"):
                bad.append(m.group(1))
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


def main() -> None:
    env = load("env.json")
    smoke = load("smoke.json").get("checks", {})
    peak = load("peak.json")
    peak_rows = peak if isinstance(peak, list) else []
    summary = {
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": (int(time.time()) - int(os.environ["GPUCHECK_START"])
                      if os.environ.get("GPUCHECK_START") else None),
        "gpu": bool(env.get("gpu_ok")), "nvvm": bool(env.get("nvvm_ok")),
        "problems": env.get("problems", []),
        "device": (env.get("cupy") or {}).get("device") if isinstance(env.get("cupy"), dict)
        else None,
        "versions": {k: env.get(k) for k in ("python", "minidl")} | {
            "cupy": (env.get("cupy") or {}).get("version") if isinstance(env.get("cupy"), dict)
            else None,
            "driver": (env.get("cupy") or {}).get("driver_version")
            if isinstance(env.get("cupy"), dict) else None,
            "numba": env.get("numba"), "torch": env.get("torch")},
        "stages": stages(),
        "smoke": {"passed": sum(1 for v in smoke.values() if v.get("ok")),
                  "failed": {k: v.get("error") for k, v in smoke.items() if not v.get("ok")}},
        "tests": junit("junit.xml", "tests.log"),
        "peak": [{k: v for k, v in r.items() if k != "traceback"} for r in peak_rows],
        "peak_all_equal": bool(peak_rows) and all(r.get("dry_equal") for r in peak_rows),
        "cli": cli_pairs(),
        "bench": bench(),
        "swap": load("swap.json"),
    }
    with open(os.path.join(OUT, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps({k: summary[k] for k in ("gpu", "problems", "smoke", "peak_all_equal",
                                              "bench")}, default=str)[:3000])
    print(json.dumps({"tests": {k: v for k, v in summary["tests"].items()
                                if k != "not_passed"}}, default=str))


if __name__ == "__main__":
    main()
