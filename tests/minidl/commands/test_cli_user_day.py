"""Part 28, a user's day: what ended in a traceback or was taken silently, now one line. Ctrl-C
during ``train`` (where it stopped, what was saved, how to resume; exit 130), output piped into
a reader that stops early, every output path checked before any work (named by its flag and
its own noun, never a temporary file), a host-memory bound too small, a model too large for
the machine refused before its parameters exist. Each case runs the real command (in a
subprocess where a signal or a pipe is the point)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minidl.cli import main
from minidl.memory.ir.units import format_size
from minidl.net.param_memory import ParameterMemoryError, check_parameter_memory
from minidl.zoo.models import get_model

MINIDL = shutil.which("minidl", path=os.path.dirname(sys.executable)) or shutil.which("minidl")
CMD = [MINIDL] if MINIDL else [sys.executable, "-m", "minidl"]
TRAIN = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--width", "4"]


def one_error(capsys, argv: list[str], code: int = 2) -> str:
    """Run ``minidl argv`` in this process: its one ``minidl: error:`` line (exit ``code``),
    nothing on stdout."""
    assert main(argv) == code
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert out == "" and len(lines) == 1 and lines[0].startswith("minidl: error: "), err
    return lines[0]


# ------------------------------------------------------------------ Ctrl-C during train
def interrupt_after_step(argv: list[str], step: int, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``minidl argv`` (printing a line per step), send it SIGINT once step ``step``'s line
    is out, and wait for it."""
    proc = subprocess.Popen([*CMD, *argv, "--log-every", "1"], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"step {step}/"):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


def test_ctrl_c_saves_the_checkpoint_and_prints_the_command_that_resumes(tmp_path):
    ck = tmp_path / "ck.npz"
    argv = [*TRAIN, "--epochs", "50", "--max-steps", "400", "--save", str(ck)]
    res = interrupt_after_step(argv, 2, tmp_path)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr and "KeyboardInterrupt" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    # the step the signal came in finishes: the state saved is whole
    assert last.startswith("minidl: interrupted at step "), last
    step = int(last.split("at step ")[1].split()[0])
    assert step >= 2 and "(epoch 1 of 50)" in last
    assert f"checkpoint saved to {ck}" in last
    resume = last.split("resume with: ")[1].split()
    assert resume[0] == "minidl" and resume[-2:] == ["--resume", str(ck)]
    assert ck.is_file()
    # the command it prints continues the run (to --max-steps, from the saved step)
    done = subprocess.run([*CMD, *resume[1:-2], "--max-steps", str(step + 2), "--quiet",
                           "--resume", str(ck)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "steps: 2," in done.stdout


def test_ctrl_c_without_save_says_nothing_was_saved(tmp_path):
    res = interrupt_after_step([*TRAIN, "--epochs", "50"], 1, tmp_path)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("minidl: interrupted at step ") and "nothing saved" in last, last
    assert "--save FILE" in last
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ pipes closed early
@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("snap") / "plan.pickle"
    assert main(["plan", "lenet5", "--input", "1x8x8", "--batch-size", "2", "--snapshot",
                 str(path)]) == 0
    return path


@pytest.mark.parametrize("argv", [["show-memory", "{snap}"], ["plan", "lenet5", "--layers"]])
def test_a_reader_gone_ends_the_command_quietly(argv, snapshot):
    """Output into a pipe whose reader closed (``| head`` done): no BrokenPipeError."""
    r, w = os.pipe()
    os.close(r)  # (the reader is gone before the first byte: every write fails)
    try:
        res = subprocess.run([*CMD, *(a.format(snap=snapshot) for a in argv)], stdout=w,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
    assert res.stderr == ""


def test_show_memory_into_head(snapshot):
    res = subprocess.run(f"{' '.join(CMD)} show-memory {snapshot} | head -2", shell=True,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 2
    assert res.stderr == ""


# ------------------------------------------------------------------ output paths
OUTPUTS = [
    (["plan", "smallcnn", "--snapshot", "{missing}/p.pickle"], "--snapshot", "memory snapshot"),
    (["plan", "smallcnn", "--plot", "{missing}/p.png"], "--plot", "plot"),
    (["plan", "smallcnn", "--trace", "{missing}/p.json"], "--trace", "trace"),
    ([*TRAIN, "--max-steps", "2", "--save", "{missing}/ck.npz"], "--save", "checkpoint"),
    ([*TRAIN, "--max-steps", "2", "--log", "{missing}/log.csv"], "--log", "metric log"),
    ([*TRAIN, "--max-steps", "2", "--trace", "{missing}/t.json"], "--trace", "trace"),
    (["show-memory", "{snap}", "--trace", "{missing}/t.json"], "--trace", "trace"),
    (["export", "lenet5", "--onnx", "{missing}/m.onnx"], "--onnx", "ONNX model"),
    (["compress", "ck.npz", "--model", "lenet5", "--out", "{missing}/m.mdl"], "--out",
     "compressed model"),
]


@pytest.mark.parametrize("argv,flag,noun", OUTPUTS)
def test_an_output_in_a_missing_folder_is_refused_before_any_work(capsys, tmp_path, snapshot,
                                                                   argv, flag, noun):
    missing = tmp_path / "no" / "such"
    argv = [a.format(missing=missing, snap=snapshot) for a in argv]
    line = one_error(capsys, argv)
    path = argv[argv.index(flag) + 1]
    assert f"{flag} {path}: folder {missing} does not exist" in line
    assert f"the {noun} cannot be written" in line


def test_an_output_folder_that_takes_no_files_is_refused_by_its_flag(capsys, tmp_path):
    """/proc (and a read-only folder even for root): the error names the path asked for and
    comes before the run, not after it with a temporary file's name."""
    for argv, flag in (([*TRAIN, "--max-steps", "2", "--save", "/proc/ck.npz"], "--save"),
                       ([*TRAIN, "--max-steps", "2", "--trace", "/proc/x.json"], "--trace")):
        line = one_error(capsys, argv)
        assert line.startswith(f"minidl: error: {flag} /proc/") and "tmp" not in line, line
        assert "cannot create files in folder /proc" in line
    assert not list(tmp_path.iterdir())


def test_an_output_that_is_a_folder_is_refused(capsys, tmp_path):
    line = one_error(capsys, [*TRAIN, "--max-steps", "2", "--log", str(tmp_path)])
    assert f"--log {tmp_path}: that is a folder; give the metric log's file name" in line


def test_a_checkpoint_write_error_names_the_checkpoint_not_a_temporary_file(tmp_path):
    from minidl.interop.checkpoint import write_npz
    with pytest.raises(OSError) as e:
        write_npz("/proc/ck.npz", {"a": [1]})
    assert e.value.filename == "/proc/ck.npz"


# ------------------------------------------------------------------ memory
def test_a_host_memory_bound_too_small_is_one_line(capsys):
    line = one_error(capsys, [*TRAIN, "--max-steps", "2", "--host-memory", "1KiB", "--memory",
                              "reuse,swap=all", "--quiet"], code=1)
    assert "host pool bound 1.00 KiB" in line and "raise --host-memory" in line


def test_a_model_too_large_for_the_machine_is_refused_before_its_parameters_exist(capsys):
    argv = ["train", "smallcnn", "--width", "100000", "--input", "1x8x8", "--dataset",
            "synthetic", "--max-steps", "2"]
    line = one_error(capsys, argv)
    assert "smallcnn --width 100000: the parameters of smallcnn need" in line
    assert "of memory available; lower --width" in line
    # what it needs: the convs' (and fc's) float32 values, counted from their shapes
    needed = 4 * (100000 * 1 * 9 + 100000 + 200000 * 100000 * 9 + 200000 + 200000 * 4 * 10 + 10)
    assert f"need {format_size(needed)}" in line


def test_a_model_too_large_for_the_machine_is_planned_without_its_parameters(capsys):
    """``minidl plan`` builds the model with deferred parameters (no values drawn): a model
    whose weights this machine could not hold is planned, and the plan says what it needs."""
    assert main(["plan", "smallcnn", "--width", "100000", "--input", "1x8x8"]) == 0
    out = capsys.readouterr().out
    assert "peak allocated:" in out and "TiB" in out
    assert "conv2.weight" in out  # (the 720 GB parameter, counted from its shape)


def test_the_parameter_check_counts_the_shapes_it_is_given():
    net = get_model("smallcnn", input_shape=(1, 8, 8), num_classes=10, width=4)
    specs = [s for node in net.nodes for s in node.layer.param_specs().values()]
    nbytes = 4 * net.num_parameters()
    check_parameter_memory("smallcnn", specs, "float32", available=10 * nbytes)
    with pytest.raises(ParameterMemoryError) as e:
        check_parameter_memory("smallcnn", specs, "float32", available=nbytes)
    assert e.value.needed_bytes > nbytes and "smallcnn" in str(e.value)


# ------------------------------------------------------------------ accepted silently, no more
VALID_FLAGS = "valid: none, reuse, inplace"


@pytest.mark.parametrize("spec, needle", [("", "--memory '' is empty"),
                                          ("  ", "--memory '  ' is empty"),
                                          ("reuse,,inplace", "--memory 'reuse,,inplace' has an "
                                                             "empty flag"),
                                          ("reuse,", "--memory 'reuse,' has an empty flag")])
def test_an_empty_memory_spec_or_flag_is_refused(capsys, spec, needle):
    for argv in (["plan", "lenet5", "--input", "1x8x8"], [*TRAIN, "--max-steps", "2"]):
        line = one_error(capsys, [*argv, "--memory", spec])
        assert needle in line and VALID_FLAGS in line


@pytest.mark.parametrize("argv, needle", [
    (["plan", "lenet5", "--budget", "999999TiB"], "--budget 999999TiB: a budget of 976.56 PiB"),
    (["plan", "lenet5", "--memory", "auto,budget=999999TiB"],
     "--memory auto,budget=999999TiB: a budget of 976.56 PiB"),
    ([*TRAIN, "--memory", "auto", "--budget", "2048TiB"], "--budget 2048TiB: a budget of 2.00 "
                                                          "PiB"),
])
def test_an_absurd_budget_is_refused(capsys, argv, needle):
    line = one_error(capsys, argv)
    assert needle in line and "up to 1024TiB" in line


def test_a_budget_up_to_a_pebibyte_is_taken(capsys):
    assert main(["plan", "lenet5", "--input", "1x8x8", "--budget", "1024TiB"]) == 0
    assert "the plan fits" in capsys.readouterr().out


@pytest.mark.parametrize("model, shape, needles", [
    ("lenet5", "1x2x2", ["its first layer, conv1, has a 5x5 window, larger than the 2x2 image",
                         "the smallest square input it takes with C=1 is 1x5x5"]),
    ("resnet50", "3x1x1", ["its first layer, conv1, has a 3x3 window, larger than the 1x1 "
                           "image", "is 3x5x5"]),
    ("resnet50", "3x3x3", ["shrunk to 1x1 before layer4.0.conv2, which downsamples by 2x2",
                           "is 3x5x5"]),
])
def test_an_input_the_model_collapses_is_refused(capsys, model, shape, needles):
    line = one_error(capsys, ["plan", model, "--input", shape])
    assert line.startswith(f"minidl: error: --input {shape} is too small for {model}: ")
    for needle in needles:
        assert needle in line


@pytest.mark.parametrize("model, shape", [("lenet5", "1x5x5"), ("lenet5", "1x8x8"),
                                          ("resnet50", "3x5x5"), ("resnet8", "3x8x8")])
def test_the_smallest_inputs_named_are_taken(capsys, model, shape):
    assert main(["plan", model, "--input", shape, "--batch-size", "2"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("name, needle", [("ck.txt", "'.txt' is not a checkpoint format"),
                                          ("ck", "no suffix")])
def test_save_takes_the_checkpoint_suffixes_only(capsys, tmp_path, name, needle):
    path = tmp_path / name
    line = one_error(capsys, [*TRAIN, "--max-steps", "2", "--save", str(path)])
    assert f"--save {path}: {needle}" in line
    assert "valid: .npz (a resumable checkpoint), .safetensors (the weights only)" in line
    assert not path.exists()


def _images(folder: Path, per_class: dict[str, int]) -> list[Path]:
    import numpy as np
    from PIL import Image

    out = []
    for cls, n in per_class.items():
        (folder / cls).mkdir(parents=True)
        for i in range(n):
            path = folder / cls / f"{i}.png"
            Image.fromarray(np.full((6, 6), 40 * i, np.uint8), "L").save(path)
            out.append(path)
    return out


def _folder_error(capsys, folder: Path) -> str:
    return one_error(capsys, ["train", "smallcnn", "--dataset", "folder", "--data-dir",
                              str(folder), "--input", "1x6x6", "--width", "4", "--epochs", "2",
                              "--quiet"], code=1)


def test_a_folder_of_one_image_is_refused(capsys, tmp_path):
    pytest.importorskip("PIL")
    _images(tmp_path, {"cat": 1})
    line = _folder_error(capsys, tmp_path)
    assert f"{tmp_path}: 1 image in 1 class folder(s)" in line and "at least 2" in line


def test_an_empty_class_folder_is_refused(capsys, tmp_path):
    pytest.importorskip("PIL")
    _images(tmp_path, {"cat": 3, "dog": 3})
    (tmp_path / "emu").mkdir()
    line = _folder_error(capsys, tmp_path)
    assert f"{tmp_path}: class folder(s) 'emu' hold no images" in line


def test_a_truncated_image_is_refused_while_indexing(capsys, tmp_path):
    """Found before the first step (an epoch that never reads it would not find it)."""
    pytest.importorskip("PIL")
    paths = _images(tmp_path, {"cat": 4, "dog": 4})
    data = paths[5].read_bytes()
    paths[5].write_bytes(data[: len(data) // 2])
    line = _folder_error(capsys, tmp_path)
    assert f"cannot read image {paths[5]}: " in line
    assert "truncated" in line.lower()
    # (streamed: opening the folder reads no image's pixels, yet the bad one is found)
    from minidl.datasets.data import load_dataset
    from minidl.datasets.image_sources import ImageReadError

    with pytest.raises(ImageReadError, match=f"cannot read image {paths[5]}"):
        load_dataset("folder", data_dir=tmp_path, input_shape=(1, 6, 6), lazy=True)


@pytest.mark.parametrize("kw", [{"epochs": 0}, {"epochs": 2.5}, {"max_steps": 0},
                                {"batch_size": 0}])
def test_fit_refuses_counts_that_train_nothing(kw):
    import numpy as np

    from minidl.train.trainer import Trainer

    trainer = Trainer(get_model("smallcnn", input_shape=(1, 8, 8), num_classes=2, width=2))
    x, y = np.zeros((4, 1, 8, 8), np.float32), np.zeros(4, np.int64)
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"fit: {name} must be a whole number >= 1, got "
                                         rf"{value!r}"):
        trainer.fit((x, y), progress=False, **kw)
    assert trainer.iteration == 0


@pytest.mark.parametrize("argv, meant", [
    ([*TRAIN, "--epoch", "5"], "--epochs"),
    ([*TRAIN, "--max-step=2"], "--max-steps"),
    (["plan", "lenet5", "--lay"], "--layers"),
    (["plan", "lenet5", "--bugdet", "1GiB"], "--budget"),
])
def test_abbreviated_or_misspelt_options_are_refused_naming_the_option(capsys, argv, meant):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "unrecognized arguments: " in err and f"did you mean {meant}?" in err


# ------------------------------------------------------------------ numbers and words
def test_the_header_says_max_steps_ends_the_run_and_counts_epochs_right(capsys):
    assert main([*TRAIN, "--max-steps", "2", "--no-progress"]) == 0
    header = capsys.readouterr().err.splitlines()[0]
    # 512 synthetic images in batches of 32: 16 steps per epoch, 30 epochs by default
    assert ", 2 steps (--max-steps; 30 epochs would be 480) of batch 32," in header
    assert main([*TRAIN, "--epochs", "1", "--no-progress"]) == 0
    assert ", 1 epoch of batch 32," in capsys.readouterr().err.splitlines()[0]


def test_an_unnamed_user_model_is_titled_by_its_function(capsys, tmp_path, monkeypatch):
    (tmp_path / "day_nets.py").write_text(
        "import minidl\n"
        "from minidl import layers as L\n\n"
        "def tiny(input_shape, num_classes):\n"
        "    x = minidl.Input(input_shape)\n"
        "    return minidl.Network(x, L.Linear(8, num_classes)(L.Flatten()(x)))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["plan", "day_nets:tiny", "--input", "1x2x4", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny, batch 2") and "network" not in out.splitlines()[0]
