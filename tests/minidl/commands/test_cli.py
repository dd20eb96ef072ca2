"""The ``minidl`` command: exit codes, JSON keys, plan == real peak, OOM handling."""

from __future__ import annotations

import json

import pytest

from minidl.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "nonet", "--input", "1x8x8"], "valid: smallcnn"),
    (["plan", "resnet7", "--input", "3x8x8"], "valid depths"),
    (["plan", "lenet5", "--input", "1x8x8", "--memory", "reuse,bogus"], "valid: none"),
    (["train", "lenet5", "--dataset", "nodata"], "valid: digits"),
    (["plan", "lenet5", "--input", "1xAx8"], "CxHxW"),
])
def test_unknown_names_exit_2_with_the_valid_ones(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert needle in err


def test_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "lenet5", "--no-such-flag"])
    assert e.value.code == 2


def test_train_json_and_plan_agree_on_the_peak(capsys, tmp_path):
    ckpt = tmp_path / "lenet.npz"
    code, out, _ = run(capsys, "train", "lenet5", "--dataset", "digits", "--max-steps", "4",
                       "--batch-size", "64", "--memory", "reuse,inplace", "--json",
                       "--no-progress",
                       "--save", str(ckpt))
    assert code == 0
    res = json.loads(out)
    for key in ("losses", "final_loss", "test_accuracy", "peak_allocated_bytes",
                "peak_reserved_bytes", "step_time_median_s", "wall_time_s"):
        assert key in res
    assert len(res["losses"]) == 4 and ckpt.exists()
    code, out, _ = run(capsys, "plan", "lenet5", "--input", "1x8x8", "--batch-size", "64",
                       "--memory", "reuse,inplace", "--json")
    plan = json.loads(out)
    for key in ("peak_allocated_bytes", "lower_bound_bytes", "breakdown", "peak_step",
                "layers"):
        assert key in plan
    assert plan["peak_allocated_bytes"] == res["peak_allocated_bytes"]


def test_too_little_device_memory_exits_1_and_writes_nothing(capsys, tmp_path):
    ckpt = tmp_path / "never.npz"
    code, _, err = run(capsys, "train", "lenet5", "--dataset", "digits", "--max-steps", "2",
                       "--device-memory", "64KiB", "--no-progress", "--save", str(ckpt))
    assert code == 1
    assert "out of memory" in err and "cannot allocate" in err
    assert not ckpt.exists()


def test_plan_auto_budget_and_max_batch(capsys):
    code, out, _ = run(capsys, "plan", "smallcnn", "--input", "1x16x16", "--batch-size", "32",
                       "--memory", "reuse,inplace", "--json")
    base = json.loads(out)
    budget = (base["lower_bound_bytes"] + base["peak_allocated_bytes"]) // 2
    code, out, _ = run(capsys, "plan", "smallcnn", "--input", "1x16x16", "--batch-size", "32",
                       "--memory", "auto", "--budget", str(budget), "--json")
    assert code == 0
    assert json.loads(out)["peak_reserved_bytes"] <= budget
    code, out, _ = run(capsys, "plan", "smallcnn", "--input", "1x16x16", "--memory", "none",
                       "--budget", str(budget), "--max-batch", "--json")
    found = json.loads(out)
    assert found["max_batch_size"] >= 1
    assert found["report"]["peak_reserved_bytes"] <= budget


def test_bench_json(capsys):
    code, out, _ = run(capsys, "bench", "smallcnn", "--input", "1x12x12", "--batch-size", "8",
                       "--memory", "none", "reuse,inplace", "--steps", "2", "--warmup", "1",
                       "--json")
    assert code == 0
    res = json.loads(out)
    assert [r["spec"] for r in res["results"]] == ["none", "reuse,inplace"]
    assert res["results"][0]["time_ratio"] == 1.0
