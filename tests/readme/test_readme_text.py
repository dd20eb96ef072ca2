"""The README as a text: only fences this suite runs, its ```python snippet run as written
(and what its comments say it does), and the lists in its prose equal to the registries."""

from __future__ import annotations

import math
import re

import pytest
from readme_runner import ALL_COMMANDS, BASH, BLOCKS, PYTHON, README


def test_the_readme_has_commands_and_only_known_fences():
    assert len(BASH) >= 6 and PYTHON and len(ALL_COMMANDS) >= 20
    assert {b.lang for b in BLOCKS} <= {"bash", "python", ""}, (
        "a fence language this test does not run: use ```bash or ```python")
    for b in BLOCKS:
        if b.lang == "":  # text (the layout): no command in it
            assert not re.search(r"^\s*(minidl|python|pip|mpiexec) ", b.text, re.M), b.id


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
