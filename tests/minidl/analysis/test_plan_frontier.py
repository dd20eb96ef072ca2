"""Issue 36, the curve as an output: ``minidl plan ... --frontier`` prints (``--json`` carries,
``--plot`` draws) the auto planner's predicted step time against the peak, the Python API
``minidl.frontier`` returns the same curve, and ``--max-batch`` under ``auto`` finds the exact
largest batch with few auto dry runs."""

from __future__ import annotations

import importlib.util
import json

import pytest

import minidl
from minidl.analysis.dryrun import _BatchSearch, dry_run, max_batch_size
from minidl.cli import main
from minidl.commands.common import build_model
from minidl.memory.planners.auto import BudgetTooSmall

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
    assert minidl.frontier is minidl.analysis.dryrun.frontier
    curve = minidl.frontier(lambda: build_model("resnet20", SHAPE, 10), 32, SHAPE,
                            target="v100")
    assert len(curve) >= 5
    # more memory, never slower (a point at the same predicted time as the one before it
    # moves or recomputes fewer bytes: ties go to less traffic)
    assert all(a["peak_bytes"] < b["peak_bytes"] and a["step_s"] >= b["step_s"]
               for a, b in zip(curve, curve[1:]))
    assert curve[-1]["summary"] == "everything kept"  # 16 GiB: nothing swapped at a tie
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


def fits(name: str, shape, batch: int, spec: str, budget: int) -> bool:
    try:
        rep = dry_run(build_model(name, shape, 10), batch, spec, input_shape=shape)
    except BudgetTooSmall:
        return False
    return rep["peak_reserved_bytes"] <= budget


@pytest.mark.parametrize("name, shape, workers", [
    ("resnet8", (3, 8, 8), 2),  # BatchNorm: never split
    ("smallcnn", (1, 6, 6), 2),  # auto may split its batches (up to 64 micro-batches)
])
def test_max_batch_under_auto_is_exact(name, shape, workers):
    make = lambda: build_model(name, shape, 10)  # noqa: E731
    budget = dry_run(make(), 4, "reuse,inplace", input_shape=shape)["peak_reserved_bytes"]
    found = max_batch_size(make, shape, "auto", budget, workers=workers)
    b = found["max_batch_size"]
    assert b >= 4 and not found["limit_reached"]
    assert found["report"]["peak_reserved_bytes"] <= budget
    assert found["report"]["batch_size"] == b
    assert fits(name, shape, b, f"auto,budget={budget}", budget)
    assert not fits(name, shape, b + 1, f"auto,budget={budget}", budget)
    assert dict(found["tried"])[b] is True and dict(found["tried"])[b + 1] is False


def test_max_batch_under_auto_tries_few_batches(capsys, monkeypatch):
    """resnet8 at 3x8x8, one process: the lean fixed specs' line lands near the answer, so a
    few auto dry runs settle it where doubling then bisecting takes a dozen."""
    # the lean plans' line predicts the batch where convolutions' workspaces are chosen for
    # memory (vDNN's rule; off by default: W.RULE_KINDS)
    from minidl.memory.options import workspace_options

    monkeypatch.setattr(workspace_options, "RULE_KINDS", ("cpu",))
    make = lambda: build_model("resnet8", (3, 8, 8), 10)  # noqa: E731
    budget = dry_run(make(), 4, "reuse,inplace", input_shape=(3, 8, 8))["peak_reserved_bytes"]
    found = max_batch_size(make, (3, 8, 8), "auto", budget, workers=1, progress=True)
    b = found["max_batch_size"]
    out = capsys.readouterr().out
    assert "checking there with auto" in out and f"  batch {b + 1}: does not fit\n" in out
    assert dict(found["tried"])[b] is True and dict(found["tried"])[b + 1] is False
    assert found["report"]["peak_reserved_bytes"] <= budget
    search = _BatchSearch(make, (3, 8, 8), minidl.MemoryConfig.parse(f"auto,budget={budget}"),
                          budget, "sgd", 1 << 16, False, None, "cpu")
    assert search.bisect()["max_batch_size"] == found["max_batch_size"]
    assert len(found["tried"]) < len(search.order)


def test_max_batch_limits_and_nothing_fits():
    make = lambda: build_model("resnet8", (3, 8, 8), 10)  # noqa: E731
    budget = dry_run(make(), 4, "reuse,inplace", input_shape=(3, 8, 8))["peak_reserved_bytes"]
    found = max_batch_size(make, (3, 8, 8), "auto", budget, limit=3, workers=1)
    assert found["max_batch_size"] == 3 and found["limit_reached"]
    none = max_batch_size(make, (3, 8, 8), "auto", 1 << 16, workers=1)
    assert none["max_batch_size"] == 0 and none["report"] is None


def test_max_batch_cli_under_auto(capsys):
    code, out, _ = run(capsys, "plan", "resnet8", "--input", "3x8x8", "--batch-size", "4",
                       "--memory", "reuse,inplace", "--json")
    budget = json.loads(out)["peak_reserved_bytes"]
    code, out, _ = run(capsys, "plan", "resnet8", "--input", "3x8x8", "--memory", "auto",
                       "--budget", str(budget), "--max-batch", "--json")
    found = json.loads(out)
    b = found["max_batch_size"]
    assert found["report"]["peak_reserved_bytes"] <= budget
    assert [b, True] in found["tried"] and [b + 1, False] in found["tried"]
