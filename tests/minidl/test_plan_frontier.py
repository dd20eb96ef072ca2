"""Issue 36, the curve as an output: ``minidl plan ... --frontier`` prints (``--json`` carries,
``--plot`` draws) the auto planner's predicted step time against the peak, the Python API
``minidl.frontier`` returns the same curve."""

from __future__ import annotations

import importlib.util
import json

import pytest
from minidl.memory.auto import BudgetTooSmall

import minidl
from minidl.cli import main
from minidl.commands.common import build_model

#: A small residual network whose curve has a dozen plans (planned in about a second).
NET = ["resnet20", "--input", "3x16x16", "--batch-size", "32", "--target", "v100"]
SHAPE = (3, 16, 16)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def table_rows(out: str) -> list[tuple[bool, float, float]]:
    """(chosen, peak MiB, step ms) of each row of the printed curve."""
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if "peak MiB" in ln and "step ms" in ln) + 1
    rows = []
    for ln in lines[start:]:
        if ln.startswith("chosen"):
            break
        fields = ln[2:].split()
        rows.append((ln.startswith("*"), float(fields[0]), float(fields[2])))
    return rows


def test_frontier_table_from_least_peak_with_times_that_never_rise(capsys):
    code, out, err = run(capsys, "plan", *NET, "--memory", "auto", "--frontier")
    assert code == 0, err
    rows = table_rows(out)
    assert len(rows) >= 5
    peaks = [r[1] for r in rows]
    times = [r[2] for r in rows]
    assert peaks == sorted(peaks) and times == sorted(times, reverse=True)
    assert times[-1] < times[0]
    assert sum(r[0] for r in rows) == 1  # the plan chosen for the target's memory
    assert "lower bound" in out and "unlimited-memory device" in out
    # the same curve as the API's, row for row
    curve = minidl.frontier(build_model("resnet20", SHAPE, 10), 32, SHAPE, target="v100")
    assert [round(p["peak_bytes"] / 2**20, 2) for p in curve] == peaks
    assert [round(1e3 * p["step_s"], 2) for p in curve] == times


def test_frontier_marks_the_budget_choice_and_json_carries_the_curve(capsys):
    code, out, _ = run(capsys, "plan", *NET, "--memory", "auto", "--frontier", "--json")
    assert code == 0
    curve = json.loads(out)["auto"]["curve"]
    mid = curve[len(curve) // 2]
    code, out, _ = run(capsys, "plan", *NET, "--memory", "auto", "--budget",
                       str(mid["peak_bytes"]), "--frontier", "--json")
    assert code == 0
    rep = json.loads(out)
    auto = rep["auto"]
    assert [p["peak_bytes"] for p in auto["curve"]] == [p["peak_bytes"] for p in curve]
    chosen = [p for p in auto["curve"] if p["chosen"]]
    assert len(chosen) == 1 and chosen[0]["peak_bytes"] <= mid["peak_bytes"]
    assert chosen[0]["step_s"] == pytest.approx(auto["chosen_step_s"])
    assert auto["chosen_step_s"] == pytest.approx(rep["prediction"]["step_s"])
    assert auto["lower_bound_s"] is None or auto["lower_bound_s"] <= auto["chosen_step_s"]
    for p in auto["curve"]:
        assert set(p) >= {"peak_bytes", "peak_over_lower_bound", "step_s", "overhead", "source",
                          "summary", "chosen", "lower_bound_s"}
        assert p["peak_bytes"] >= rep["lower_bound_bytes"] and p["overhead"] >= -1e-9
    # a plain --json report carries it too
    code, out, _ = run(capsys, "plan", *NET, "--memory", "auto", "--json")
    assert json.loads(out)["auto"]["curve"] == curve


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_frontier_plot_is_a_png(capsys, tmp_path):
    png = tmp_path / "curve.png"
    code, out, _ = run(capsys, "plan", *NET, "--memory", "auto", "--frontier",
                       "--plot", str(png))
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"frontier saved to {png}" in out


@pytest.mark.parametrize("extra, needles", [
    (["--memory", "reuse,inplace"], ["--frontier needs --memory auto", "'reuse,inplace'"]),
    (["--memory", "none"], ["--frontier needs --memory auto"]),
    (["--memory", "auto", "--max-batch", "--budget", "8MiB"], ["--frontier and --max-batch"]),
    (["--memory", "auto,only=swap"], ["--frontier", "only="]),
])
def test_frontier_usage_errors_are_one_line(capsys, extra, needles):
    code, out, err = run(capsys, "plan", *NET, *extra, "--frontier")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("minidl: error: ")
    for needle in needles:
        assert needle in lines[0]
    assert out == ""


def test_frontier_api():
    assert minidl.frontier is minidl.dryrun.frontier
    curve = minidl.frontier(lambda: build_model("resnet20", SHAPE, 10), 32, SHAPE,
                            target="v100")
    assert len(curve) >= 5
    assert all(a["peak_bytes"] < b["peak_bytes"] and a["step_s"] > b["step_s"]
               for a, b in zip(curve, curve[1:]))
    assert [p["chosen"] for p in curve] == [False] * (len(curve) - 1) + [True]  # 16 GiB
    # the curve does not depend on the budget; the choice does
    mid = curve[len(curve) // 2]
    again = minidl.frontier(build_model("resnet20", SHAPE, 10), 32, SHAPE, target="v100",
                            budget=mid["peak_bytes"])
    assert [p["peak_bytes"] for p in again] == [p["peak_bytes"] for p in curve]
    assert [p["chosen"] for p in again].index(True) == len(curve) // 2
    with pytest.raises(ValueError, match="auto"):
        minidl.frontier(build_model("resnet20", SHAPE, 10), 32, SHAPE, memory="reuse,inplace")
    with pytest.raises(BudgetTooSmall):
        minidl.frontier(build_model("resnet8", (3, 8, 8), 10), 4, (3, 8, 8), budget="64KiB")
