"""minidl plan --ranks 1,2,8 --table (minidl.analysis.estimate): one row per ZeRO stage and rank
count
with one rank's bytes at its peak by column, summing to its peak, each row the dry run of that
rank, and the largest batch per rank that fits a budget (exact: that batch fits, the next does
not). Real 2-rank runs' peaks equal the rows: tests/minidl/distributed/test_data_parallel.py."""

from __future__ import annotations

import json

import pytest

import minidl
from minidl.analysis.estimate import _largest_fitting, estimate_table, format_estimate_table
from minidl.cli import main
from minidl.zoo.models import smallcnn

SHAPE = (1, 8, 8)


def _spec(stage: int) -> str:
    return "reuse,inplace" + (f",zero={stage}" if stage else "")


def make():
    return smallcnn(SHAPE, 10, width=4)


@pytest.mark.parametrize("answer", [0, 1, 5, 8, 9, 300, 1 << 14])
@pytest.mark.parametrize("start", [1, 6, 64])
def test_largest_fitting_brackets_then_bisects(answer, start):
    tried = []

    def fits(b):
        tried.append(b)
        return b <= answer

    assert _largest_fitting(fits, start) == answer
    assert len(tried) <= 2 * 15 + 2


def test_rows_are_each_ranks_dry_run_and_sum_to_its_peak():
    rows = estimate_table(make, SHAPE, 32, "reuse,inplace", [1, 2, 8], "adam")
    assert [(r.stage, r.ranks) for r in rows] == [(0, 1), *[(s, n) for n in (2, 8)
                                                           for s in range(4)]]
    for r in rows:
        rep = minidl.dry_run(make(), 32, _spec(r.stage), "adam",
                             input_shape=SHAPE, ranks=r.ranks)
        assert r.peak_allocated == rep["peak_allocated_bytes"]
        assert r.peak_reserved == rep["peak_reserved_bytes"]
        assert r.batch_per_rank == 32 // r.ranks
        h = r.held
        assert h.parameter + h.gradient + h.optimizer_state + h.activations + h.workspace == \
            r.peak_allocated
    by = {(r.stage, r.ranks): r for r in rows}
    assert by[1, 8].held.optimizer_state < by[0, 8].held.optimizer_state  # sharded over 8
    assert by[3, 8].held.parameter < by[0, 8].held.parameter
    assert by[0, 8].held.activations < by[0, 1].held.activations  # 4 samples instead of 32


def test_max_batch_per_rank_is_exact():
    budget = 600 << 10
    rows = estimate_table(make, SHAPE, 8, "reuse,inplace", [2], stages=(0, 1), budget=budget)
    for r in rows:
        b = r.max_batch_per_rank
        assert b and b > 0

        def reserved(per_rank, r=r):
            return minidl.dry_run(make(), per_rank * r.ranks, _spec(r.stage),
                                  input_shape=SHAPE, ranks=r.ranks)["peak_reserved_bytes"]

        assert reserved(b) <= budget < reserved(b + 1)
    text = format_estimate_table(rows, budget)
    assert "max batch/rank" in text.splitlines()[0] and len(text.splitlines()) == 3


def test_cli_table_and_its_errors(capsys):
    assert main(["plan", "smallcnn", "--input", "1x8x8", "--width", "4", "--batch-size", "16",
                 "--ranks", "1,2", "--table", "--budget", "1MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["stage"], r["ranks"]) for r in out["rows"]] == [(0, 1), (0, 2), (1, 2), (2, 2),
                                                               (3, 2)]
    assert all(r["max_batch_per_rank"] is not None for r in out["rows"])
    assert main(["plan", "smallcnn", "--input", "1x8x8", "--batch-size", "16", "--ranks",
                 "1,2"]) == 2
    assert "lists several rank counts: add --table" in capsys.readouterr().err
    assert main(["plan", "smallcnn", "--batch-size", "16", "--ranks", "1,x", "--table"]) == 2
    assert "--ranks 1,x: expected a count" in capsys.readouterr().err
    assert main(["plan", "smallcnn", "--batch-size", "16", "--ranks", "32", "--table"]) == 2
    assert "needs 1 to the batch size (16), got 32" in capsys.readouterr().err
