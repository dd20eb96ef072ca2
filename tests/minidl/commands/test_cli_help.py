"""``minidl --help`` and friends say what the command does: every option has help and shows its
default, the lists of models and datasets are the registries, the defaults shown are the ones
a run uses, and a page lists every memory flag and preset. Also the command-line checks that
used to let an input pass silently (``--budget`` without ``auto``, ``zero=K`` in one process)
and the CUDA error's advice."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest

from minidl import cli
from minidl.datasets import data as D
from minidl.datasets.text import TEXT_DATASETS
from minidl.memory.ir.config import FLAGS, PRESETS
from minidl.zoo.models import MODEL_NAMES, SEQUENCE_MODELS

MINIDL = shutil.which("minidl", path=os.path.dirname(sys.executable)) or shutil.which("minidl")
TINY = ["--dataset", "synthetic", "--input", "1x8x8", "--width", "2", "--epochs", "1",
        "--max-steps", "1", "--batch-size", "8", "--no-progress"]


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [MINIDL] if MINIDL else [sys.executable, "-m", "minidl"]
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MINIDL_NUM_THREADS": "1", **(env or {})})


def one_line_error(res: subprocess.CompletedProcess, code: int) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr
    assert lines[0].startswith("minidl: error: "), lines[0]
    return lines[0]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def expanded_help(sp: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The action's help as ``--help`` prints it, unwrapped."""
    return " ".join(sp._get_formatter()._expand_help(action).split())


def option(sp: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in sp._actions if a.dest == dest)


SUBCOMMANDS = subparsers()


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_that_shows_its_default(name):
    sp = SUBCOMMANDS[name]
    for action in sp._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = expanded_help(sp, action)
        assert text.strip(), f"minidl {name} {action.option_strings or action.dest}: no help"
        d = action.default
        if not action.option_strings or d is None or d is False:
            continue
        shown = " ".join(map(str, d)) if isinstance(d, list) else str(d)
        assert shown in text, f"minidl {name} {action.option_strings[0]}: default {shown!r} " \
                              f"not in its help {text!r}"
    assert "usage: minidl " + name in sp.format_help()


def test_the_subcommand_list_has_every_subcommand():
    text = cli.build_parser().format_help()
    for name in SUBCOMMANDS:
        assert name in text
    assert "minidl memory" in text  # the epilog points at the memory page


@pytest.mark.parametrize("name", ["train", "plan", "bench"])
def test_the_model_list_is_the_registry(name):
    text = expanded_help(SUBCOMMANDS[name], option(SUBCOMMANDS[name], "model"))
    listed = re.match(r"the model: (.*?) \(resnet<N>", text).group(1).split(", ")
    assert listed == list(MODEL_NAMES)


def test_the_dataset_list_is_the_registry():
    text = expanded_help(SUBCOMMANDS["train"], option(SUBCOMMANDS["train"], "dataset"))
    m = re.match(r"image models: (.*?); text models: (.*?) \(or synthetic\)", text)
    assert m.group(1).split(", ") == list(D.DATASETS)
    assert m.group(2).split(", ") == list(TEXT_DATASETS)


@pytest.mark.parametrize("model, dataset", [("lenet5", "digits"),
                                            (SEQUENCE_MODELS[0], cli.TEXT_DEFAULT_DATASET)])
def test_the_default_dataset_fits_the_model(model, dataset):
    args = cli.build_parser().parse_args(["train", model])
    cli.validate_args(args)
    assert args.dataset == dataset
    assert dataset in (D.DATASETS if model == "lenet5" else TEXT_DATASETS)


def _shown_per_dataset(text: str, what: str) -> dict[str, str]:
    """{dataset: value} from "(default per dataset: 120 on digits, else 30)"."""
    body = re.search(r"default per dataset: ([^)]*)\)", text).group(1)
    special = dict((name, value) for value, name in re.findall(r"(\S+) on ([\w-]+)", body))
    rest = re.search(r"else (\S+)", body).group(1)
    assert set(special) <= set(D.DATASETS), (what, special)
    return {name: special.get(name, rest) for name in D.DATASETS}


def test_the_epochs_and_weight_decay_shown_are_the_real_defaults():
    t = SUBCOMMANDS["train"]
    epochs = _shown_per_dataset(expanded_help(t, option(t, "epochs")), "epochs")
    decay = _shown_per_dataset(expanded_help(t, option(t, "weight_decay")), "weight decay")
    for name in D.DATASETS:
        assert int(epochs[name]) == D.train_defaults(name).epochs, name
        assert float(decay[name]) == D.train_defaults(name).weight_decay, name


def test_a_digits_run_trains_the_epochs_the_help_shows():
    res = run("train", "smallcnn", "--dataset", "digits", "--width", "2", "--max-steps", "1",
              "--no-progress")
    assert res.returncode == 0, res.stderr
    t = SUBCOMMANDS["train"]
    shown = _shown_per_dataset(expanded_help(t, option(t, "epochs")), "epochs")["digits"]
    # (--max-steps ends it first: the header says so, and what the epochs would be)
    assert f", 1 step (--max-steps; {shown} epochs would be " in res.stderr.splitlines()[0]


def test_the_learning_rates_shown_are_the_optimizers():
    from minidl.net.optim import make_optimizer

    text = expanded_help(SUBCOMMANDS["train"], option(SUBCOMMANDS["train"], "lr"))
    for name in ("sgd", "adam", "adamw"):
        lr = make_optimizer(name, []).lr
        assert re.search(rf"{re.escape(f'{lr:g}')} for [\w/]*\b{name}\b", text), (name, text)


def _listed(page: str) -> set[str]:
    return {m.split("=")[0] for m in re.findall(r"^  (\S+)", page, re.M)}


def test_the_memory_page_lists_every_flag_and_preset(capsys):
    res = run("memory")
    assert res.returncode == 0 and not res.stderr, res.stderr
    assert _listed(res.stdout) == set(FLAGS) | set(PRESETS)
    for name, spec in PRESETS.items():
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(spec)}$", res.stdout, re.M), name
    for name, (values, _) in FLAGS.items():
        if values and not values[0].startswith("<"):
            assert f"{name}={'|'.join(values)}" in res.stdout, name
    # --memory help prints the same page, from any command that takes a spec
    capsys.readouterr()
    for argv in (["train", "lenet5"], ["plan", "lenet5"], ["bench", "lenet5"]):
        assert cli.main([*argv, "--memory", "help"]) == 0
        assert capsys.readouterr().out == res.stdout, argv
    # and every page that takes --memory points at it
    for name in ("train", "plan", "bench"):
        text = expanded_help(SUBCOMMANDS[name], option(SUBCOMMANDS[name], "memory"))
        assert "minidl memory" in text, name


# ------------------------------------------------------------------- silently accepted inputs
def test_train_budget_without_auto_is_a_usage_error_naming_the_fix():
    line = one_line_error(run("train", "smallcnn", *TINY, "--memory", "reuse",
                              "--budget", "4MiB"), 2)
    assert "--budget 4MiB" in line and "--memory auto --budget 4MiB" in line
    assert "--device-memory 4MiB" in line


def test_a_budget_given_twice_is_a_usage_error():
    line = one_line_error(run("plan", "smallcnn", "--input", "1x8x8", "--memory",
                              "auto,budget=4MiB", "--budget", "8MiB"), 2)
    assert "give it once" in line


def test_plan_budget_without_auto_checks_the_plan_against_it(capsys):
    plan = ["plan", "smallcnn", "--input", "1x8x8", "--width", "2", "--memory", "reuse"]
    assert cli.main([*plan, "--budget", "1GiB"]) == 0
    assert "the plan fits" in capsys.readouterr().out
    assert cli.main([*plan, "--budget", "1KiB"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_train_budget_with_auto_sizes_the_arena():
    res = run("train", "smallcnn", *TINY, "--memory", "auto", "--budget", "4MiB")
    assert res.returncode == 0, res.stderr
    assert "cpu device with 4.00 MiB" in res.stderr.splitlines()[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_in_one_process_says_it_runs_as_one_rank(stage):
    res = run("train", "smallcnn", *TINY, "--memory", f"reuse,zero={stage}")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note: zero=")]
    assert len(notes) == 1 and "runs as one rank" in notes[0], res.stderr
    assert f"zero={stage}" in notes[0]


def test_zero_under_mpiexec_has_no_one_rank_note(monkeypatch, capsys):
    args = cli.build_parser().parse_args(["train", "smallcnn", "--memory", "reuse,zero=2"])
    monkeypatch.setenv("PMI_SIZE", "2")  # what MPICH's mpiexec -n 2 sets
    cli.validate_args(args)
    assert "one rank" not in capsys.readouterr().err
    monkeypatch.delenv("PMI_SIZE")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cli.validate_args(args)
    assert "runs as one rank" in capsys.readouterr().err


def test_the_cuda_error_suggests_what_train_takes():
    try:
        import cupy

        if cupy.cuda.is_available():
            pytest.skip("a GPU is here: --device cuda runs")
    except Exception:  # noqa: BLE001 -- no CuPy: the other message, checked the same
        pass
    line = one_line_error(run("train", "smallcnn", *TINY, "--device", "cuda"), 1)
    assert "meta" not in line and "--device cpu" in line


def test_text_models_take_weight_decay_and_refuse_a_schedule(monkeypatch, capsys):
    """Nothing a user passes is silently ignored: the text models apply --weight-decay and
    refuse --schedule (they train steps at a constant rate)."""
    from minidl.cli import main
    from minidl.commands import train as train_command

    seen = []
    real = train_command.make_optimizer
    monkeypatch.setattr(train_command, "make_optimizer",
                        lambda *a, **k: seen.append(a[3]) or real(*a, **k))
    base = ["train", "char-lstm", "--dataset", "synthetic", "--max-steps", "1", "--seq-len",
            "8", "--batch-size", "2", "--json", "--no-progress"]
    assert main([*base, "--weight-decay", "0.01"]) == 0
    assert main(base) == 0
    assert seen == [0.01, 0.0]
    capsys.readouterr()
    assert main([*base, "--schedule", "step"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--schedule step: the text models train" in err[0]
