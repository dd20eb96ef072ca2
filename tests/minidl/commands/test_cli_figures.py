"""Part 28, numbers and words that mislead: every figure a person reads in the units they would
use. Budgets in binary units in specs, notes and the out-of-memory hint (parsed back to the
same bytes); times over 10 s in seconds; "program step" for a step of the program, not an
iteration; the exact bytes where two rounded figures would read the same."""

from __future__ import annotations

import io
import os
import stat

import numpy as np
import pytest

from minidl.cli import main
from minidl.commands.common import print_memory_report
from minidl.commands.plan import print_frontier, print_prediction
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.units import format_duration, parse_size, readable_figures, size_text
from minidl.memory.options.attention_options import _stash_against

TRAIN = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--width", "4"]


# ------------------------------------------------------------------ budgets in binary units
@pytest.mark.parametrize("nbytes, text", [(17179869184, "16GiB"), (1048576, "1MiB"),
                                          (1536 << 20, "1536MiB"), (10**9, "1GB"),
                                          (1000001, "1000001"), (512, "512")])
def test_size_text_is_exact_and_parses_back(nbytes, text):
    assert size_text(nbytes) == text
    assert parse_size(text) == nbytes


def test_spec_prints_the_budget_in_binary_units_and_parses_to_the_same_bytes():
    c = MemoryConfig.parse("auto,budget=17179869184,planner=greedy")
    assert c.spec == "auto,budget=16GiB,planner=greedy"
    assert c.budget == 17179869184 and MemoryConfig.parse(c.spec) == c
    odd = MemoryConfig.parse("auto,budget=1000001")
    assert odd.spec == "auto,budget=1000001" and MemoryConfig.parse(odd.spec) == odd


def test_the_oom_hint_suggests_the_budget_in_binary_units(capsys):
    code = main([*TRAIN, "--device-memory", "1MiB", "--max-steps", "1", "--batch-size", "512"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "--memory auto,budget=1MiB " in err and "budget=1048576" not in err


# ------------------------------------------------------------------ notes and times
def test_notes_read_in_binary_units_and_seconds():
    note = ("auto: budget 17,179,869,184 B; peak 17,116,981,248 B, estimated overhead "
            "64069.67 ms per iteration; next (1220907.54 ms); 512 B; 3.50 ms; "
            "16.00 GiB (17,179,869,184 B)")
    assert readable_figures(note) == (
        "auto: budget 16.00 GiB (17,179,869,184 B); peak 15.94 GiB (17,116,981,248 B), "
        "estimated overhead 64.07 s per iteration; next (1,220.91 s); 512 B; 3.50 ms; "
        "16.00 GiB (17,179,869,184 B)")


def test_format_duration_switches_to_seconds_over_10_s():
    assert format_duration(64.06967) == "64.07 s"
    assert format_duration(9.5) == "9500.00 ms"
    assert format_duration(0.0034) == "3.40 ms"


def test_memory_report_says_program_step_and_prints_notes_readably():
    rep = {"memory": "auto,budget=16GiB", "peak_allocated_bytes": 1 << 30,
           "peak_reserved_bytes": 1 << 30,
           "peak_step": {"layer": "conv2", "phase": "backward", "index": 21},
           "notes": ["auto: budget 17,179,869,184 B; overhead 64069.67 ms per iteration"]}
    buf = io.StringIO()
    print_memory_report(rep, out=buf)
    out = buf.getvalue()
    assert "conv2 (backward, program step 21)" in out
    assert "note: auto: budget 16.00 GiB (17,179,869,184 B); overhead 64.07 s" in out


def test_prediction_and_frontier_print_long_steps_in_seconds(capsys):
    print_prediction({"target_description": "a V100", "step_s": 1220.90754, "oracle_s": 1156.8,
                      "overhead": 0.055, "stall_s": 0.0021, "recompute_s": 64.07,
                      "codec_s": 0.0, "offloaded_bytes": 1 << 30, "prefetched_bytes": 1 << 30},
                     out=(buf := io.StringIO()))
    out = buf.getvalue()
    assert "step time:             1,220.91 s (an unlimited-memory device: 1,156.80 s" in out
    assert "stall waiting for copies: 2.10 ms per step; recomputed forward 64.07 s" in out
    print_prediction({"target_description": "a V100", "step_s": 1.0, "oracle_s": 0.5,
                      "overhead": 1.0, "stall_s": 0.0, "recompute_s": 0.0, "codec_s": 0.0,
                      "offloaded_bytes": 0, "prefetched_bytes": 0}, out=(buf := io.StringIO()),
                     host={"host_update_s": 0.75, "parameter_upload_s": 0.25})
    assert ("step time:             2000.00 ms: the device's 1000.00 ms, the host update "
            "750.00 ms, the parameters back 250.00 ms (an unlimited-memory device: 500.00 ms; "
            "overhead 300.0 %)") in buf.getvalue()
    curve = [{"chosen": i == 1, "peak_bytes": (16 - i) << 30, "peak_over_lower_bound": 1.5,
              "step_s": 1200.0 + i, "overhead": 0.05, "lower_bound_s": 1100.0,
              "source": "rotor", "summary": "x"} for i in range(2)]
    print_frontier({"auto": {"lower_bound_bytes": 8 << 30, "curve": curve, "split": 1,
                             "chosen_peak_bytes": 15 << 30, "chosen_step_s": 1201.0,
                             "lower_bound_s": 1100.0, "oracle_s": 1150.0}}, 16 << 30)
    out = capsys.readouterr().out
    assert "step s" in out and "bound s" in out and "step ms" not in out
    assert "   1201.00 " in out
    assert "1,201.00 s per step" in out and "an unlimited-memory device: 1,150.00 s" in out


# ------------------------------------------------------------------ the attention note
def test_attention_note_shows_bytes_when_the_rounded_figures_agree():
    same = _stash_against(14495514624, 14495514624)
    assert same == ("13.50 GiB (14,495,514,624 B) over the iteration, as much as with the "
                    "probabilities kept")
    close = _stash_against(14495514624, 14495514624 + 4096)
    assert "(14,495,514,624 B)" in close and "(14,495,518,720 B)" in close
    apart = _stash_against(100, 1 << 30)
    assert apart == "100 B over the iteration, against 1.00 GiB with the probabilities kept"


# ------------------------------------------------------------------ --max-batch, bench
def test_max_batch_shows_the_bytes_when_the_peak_rounds_to_the_budget():
    from minidl.analysis.batch_search import _BatchSearch
    from minidl.zoo.models import get_model

    search = _BatchSearch(lambda: get_model("lenet5"), (1, 28, 28), MemoryConfig.parse("none"),
                          1 << 30, "sgd", 1024, False, None, "meta")
    assert search.peak_text((1 << 30) + 4096) == (
        "peak reserved 1.00 GiB (1,073,745,920 B) against the budget's 1,073,741,824 B")
    assert search.peak_text(3 << 30) == "peak reserved 3.00 GiB"


def test_bench_table_has_one_meaning_per_column():
    import argparse

    from minidl.commands.bench import print_bench

    result = {"results": [{"spec": "none", "peak_allocated_bytes": 3 << 20,
                           "step_time_median_s": 0.010, "time_ratio": 1.0},
                          {"spec": "reuse,inplace", "peak_allocated_bytes": 2 << 20,
                           "step_time_median_s": 0.012, "time_ratio": 1.2}],
              "torch": {"step_time_median_s": 0.005, "time_ratio": 2.0, "device": "cpu"}}
    args = argparse.Namespace(model="smallcnn", batch_size=8, steps=5, device="cpu")
    buf = io.StringIO()
    import contextlib
    with contextlib.redirect_stdout(buf):
        print_bench(args, (1, 16, 16), result)
    lines = buf.getvalue().splitlines()
    assert lines[1].split()[-2:] == ["x", "first"] and "ratio" not in buf.getvalue()
    rows = {ln.split()[0]: ln.split() for ln in lines[2:5]}
    assert rows["none"][1:] == ["3.00", "MiB", "10.00", "1.000"]
    assert rows["reuse,inplace"][-1] == "1.200"
    assert rows["pytorch"][-1] == "0.500"  # PyTorch's step over the first spec's, as above it
    assert "x first: median step time over the first spec's (none)" in lines
    assert "minidl with none takes 2.000x PyTorch's step time (slower)" in lines


# ------------------------------------------------------------------ a model's own input
@pytest.mark.parametrize("model, shape", [("resnet20", "3x32x32"), ("resnet110", "3x32x32"),
                                          ("resnet18", "3x224x224"), ("lenet5", "1x28x28")])
def test_plan_defaults_to_the_models_own_input(capsys, model, shape):
    from minidl.commands.common import own_input_shape

    assert "x".join(map(str, own_input_shape(model))) == shape
    if model == "resnet20":  # (the others' shapes are the zoo's, as before)
        assert main(["plan", model, "--batch-size", "2"]) == 0
        head = capsys.readouterr().out.splitlines()[0]
        assert head.startswith(f"resnet20, batch 2, input {shape}, 10 classes: ")
        assert head.endswith(" tensors") and " program steps, " in head


# ------------------------------------------------------------------ file modes
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_traces_are_written_0644_as_other_files(tmp_path, capsys, umask_022):
    trace, snap, again = tmp_path / "plan.json", tmp_path / "plan.mem", tmp_path / "again.json"
    assert main(["plan", "lenet5", "--batch-size", "2", "--trace", str(trace),
                 "--snapshot", str(snap)]) == 0
    assert main(["show-memory", str(snap), "--trace", str(again)]) == 0
    capsys.readouterr()
    assert stat.S_IMODE(trace.stat().st_mode) == 0o644
    assert stat.S_IMODE(again.stat().st_mode) == 0o644
    os.umask(0o077)  # a stricter umask is kept, as open() keeps it
    assert main(["show-memory", str(snap), "--trace", str(again)]) == 0
    assert stat.S_IMODE(again.stat().st_mode) == 0o600


# ------------------------------------------------------------------ one phase per figure
def test_report_prints_the_training_peak_beside_its_breakdown_when_evaluation_peaked():
    rep = {"device": "cpu", "memory": "reuse", "peak_allocated_bytes": 5 << 20,
           "peak_reserved_bytes": 6 << 20, "iteration_peak_bytes": 3 << 20,
           "evaluation_peak_bytes": 5 << 20, "evaluation_batch_size": 256,
           "peak_step": {"layer": "conv2", "phase": "backward", "index": 21},
           "breakdown": {"feature_map": 2 << 20, "parameter": 1 << 20},
           "largest_live": [{"tensor": "conv1", "category": "feature_map", "bytes": 1 << 20}]}
    buf = io.StringIO()
    print_memory_report(rep, out=buf)
    lines = buf.getvalue().splitlines()
    at = lines.index("  bytes by category at the training iteration's peak:")
    assert lines[at - 1] == "  training peak at:      conv2 (backward, program step 21)"
    assert lines[at - 3] == "  training iteration:    3.00 MiB (3,145,728 B) at its peak"
    assert lines[at - 2].startswith("  evaluation:            5.00 MiB (5,242,880 B) at its "
                                    "peak (batch 256, eval mode)")
    assert sum(rep["breakdown"].values()) == rep["iteration_peak_bytes"]
    assert "  largest tensors live at the training iteration's peak:" in lines
    same = dict(rep, iteration_peak_bytes=5 << 20)
    buf = io.StringIO()
    print_memory_report(same, out=buf)
    assert "  bytes by category at the peak:" in buf.getvalue()
    assert "training iteration" not in buf.getvalue()


# ------------------------------------------------------------------ each file by its own noun
def test_atomic_writes_name_the_file_by_its_own_noun(tmp_path, capsys):
    from minidl.analysis.memory_record import load_snapshot
    from minidl.interop.checkpoint import write_json, write_npz
    from minidl.interop.memory_viz import save_torch_snapshot

    assert main(["plan", "lenet5", "--batch-size", "2", "--snapshot", str(tmp_path / "s.json")
                 ]) == 0
    capsys.readouterr()
    snap = load_snapshot(tmp_path / "s.json")
    gone = tmp_path / "gone"
    with pytest.raises(FileNotFoundError, match=r"^cannot write trace .*t\.json: folder"):
        write_json(gone / "t.json", {})
    with pytest.raises(FileNotFoundError, match=r"^cannot write memory snapshot .*s\.pickle"):
        save_torch_snapshot(snap, gone / "s.pickle")
    with pytest.raises(IsADirectoryError, match=r"^cannot write checkpoint .*: it is a folder"):
        write_npz(str(tmp_path), {})


# ------------------------------------------------------------------ compress's file sizes
def test_compression_summary_gives_the_file_size_in_binary_units():
    from minidl.compression.report import format_table, raw_row

    row = raw_row("fc.bias", "fc", np.zeros(4096, np.float32), b"x" * 16390)
    text = format_table([row], {"baseline": 0.5}, 7731)
    assert "the file (7.55 KiB, header and checksum included)" in text
    assert "7,731 bytes" not in text


def test_compress_and_export_say_file_sizes_in_binary_units(tmp_path, capsys):
    ck, mdc, onnx_file = tmp_path / "l5.npz", tmp_path / "l5.mdc", tmp_path / "l5.onnx"
    assert main(["train", "lenet5", "--max-steps", "1", "--save", str(ck), "--quiet"]) == 0
    assert main(["compress", str(ck), "--model", "lenet5", "--retrain-steps", "0", "--rounds",
                 "1", "--out", str(mdc)]) == 0
    out = capsys.readouterr().out
    size = mdc.stat().st_size
    line = next(ln for ln in out.splitlines() if ln.startswith(f"wrote {mdc}: "))
    assert line.startswith(f"wrote {mdc}: {size / 1024:.2f} KiB ({size:,} B), ")
    assert "the 173.54 KiB (177,704 B) of float32 parameters" in line
    pytest.importorskip("onnx")
    assert main(["export", str(ck), "--model", "lenet5", "--onnx", str(onnx_file)]) == 0
    size = onnx_file.stat().st_size
    assert f", {size / 1024:.2f} KiB ({size:,} B)" in capsys.readouterr().out


# ------------------------------------------------------------------ compress's epoch count
def test_compress_retraining_prints_the_epochs_it_runs_and_trains_as_one_fit(capsys):
    import functools

    from minidl.compression.pipeline import CompressionSettings, Retraining, _Stages
    from minidl.datasets.data import load_dataset, random_shift
    from minidl.zoo.models import get_model

    ds = load_dataset("synthetic", input_shape=(1, 8, 8), n_train=100, n_test=20,
                      progress=False)
    s = CompressionSettings(retraining=Retraining(batch_size=32, shift_probability=0.5))
    # 4 steps per epoch
    nets = [get_model("smallcnn", (1, 8, 8), ds.num_classes, width=4) for _ in range(2)]
    split, one = (_Stages(net, ds, s, progress=True) for net in nets)
    t = split.trainer(split.optimizer(nets[0].parameters()))
    split.train(t, 10)  # 2 whole epochs and 2 steps of a third
    lines = [ln.split(":")[0] for ln in capsys.readouterr().err.splitlines()
             if ln.startswith("epoch ")]
    assert lines == ["epoch 1/2", "epoch 2/2"] and t.iteration == 10
    ref = one.trainer(one.optimizer(nets[1].parameters()))
    ref.fit(ds, epochs=3, max_steps=10, batch_size=32, progress=False, evaluate=False,
            augment=functools.partial(random_shift, probability=0.5, fill=ds.background))
    for (name, a), b in zip(nets[0].state_dict().items(), nets[1].state_dict().values()):
        np.testing.assert_array_equal(a, b, err_msg=name)
    t.close()
    ref.close()


def test_frontier_plot_axis_in_seconds_for_long_steps():
    from minidl.commands.plan import time_unit

    assert time_unit([0.004, 1220.9]) == ("s", 1.0)
    assert time_unit([0.004, 9.9]) == ("ms", 1e3)
