"""The specs suggested when a budget is not met: the dry runs of the run they are for (its
precision), no second auto search after the caller's own, and no fixed spec tried once the
persistent state alone fills the capacity."""

from __future__ import annotations

from minidl.analysis import dryrun
from minidl.analysis.dryrun import SUGGESTIONS, dry_run, suggest_specs
from minidl.zoo.models import get_model

SHAPE = (1, 28, 28)


def _lenet():
    return get_model("lenet5", SHAPE, 10)


def _counting(monkeypatch) -> list[str]:
    specs: list[str] = []

    def counted(net, batch, spec, *args, **kwargs):
        specs.append(str(spec))
        return dry_run(net, batch, spec, *args, **kwargs)

    monkeypatch.setattr(dryrun, "dry_run", counted)
    return specs


def test_suggestions_are_dry_runs_in_the_run_s_precision():
    half = dry_run(_lenet(), 32, "reuse,inplace", input_shape=SHAPE, precision="bf16-mixed")
    full = dry_run(_lenet(), 32, "reuse,inplace", input_shape=SHAPE)
    assert half["peak_reserved_bytes"] < full["peak_reserved_bytes"]
    capacity = half["peak_reserved_bytes"]
    fits = suggest_specs(_lenet, 32, SHAPE, capacity, auto_tried=True, precision="bf16-mixed")
    plain = {f["memory"]: f["peak_reserved_bytes"] for f in fits}
    assert plain["reuse,inplace"] == half["peak_reserved_bytes"]
    assert all(peak <= capacity for peak in plain.values())


def test_no_second_auto_search_after_the_caller_s(monkeypatch):
    specs = _counting(monkeypatch)
    suggest_specs(_lenet, 32, SHAPE, 1 << 30, auto_tried=True)
    assert specs == list(SUGGESTIONS)
    specs.clear()
    suggest_specs(_lenet, 32, SHAPE, 1 << 30)
    assert specs[0].startswith("auto,budget=") and specs[1:] == list(SUGGESTIONS)


def test_no_fixed_spec_runs_once_the_persistent_state_fills_the_capacity(monkeypatch):
    persistent = dry_run(_lenet(), 32, "reuse,inplace", input_shape=SHAPE)["persistent_bytes"]
    specs = _counting(monkeypatch)
    assert suggest_specs(_lenet, 32, SHAPE, persistent, auto_tried=True) == []
    assert specs == [SUGGESTIONS[0]]
