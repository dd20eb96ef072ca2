"""Every command of the README's ```bash blocks, run as written or scaled (the tables of
readme_runner.py), and what the README says each does, checked; the lines not run here, each
with its reason."""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest
from readme_runner import (
    ABOUT_SLACK,
    ALL_COMMANDS,
    AS_WRITTEN,
    BASH,
    EXTRAS,
    GPU_ONLY,
    NOT_A_RUN,
    PYTHON,
    PYTHON_AS_WRITTEN,
    SCALED,
    SLOW_S,
    Command,
    Ran,
    commands,
    execute,
    gpu_problem,
    handling,
    mpi_launcher,
    required_modules,
    starts,
    stated_time,
)


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
                 if starts(c.key, "minidl train resnet20") and "--resume" not in c.argv)
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
    gpt = [c for c in ALL_COMMANDS if starts(c.key, "minidl train gpt-char")]
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
        check = next((f for p, f in CHECKS.items() if starts(cmd.key, p)), None)
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
