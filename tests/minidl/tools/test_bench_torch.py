"""``bench --compare-torch`` times PyTorch in a process of its own, never in minidl's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = r"""
import functools, json, sys
from minidl.tools.bench import run_bench
from minidl.memory.ir.config import MemoryConfig
from minidl.zoo.models import get_model

make = functools.partial(get_model, "smallcnn", (1, 12, 12), 4)
out = run_bench(make, (1, 12, 12), 8, [MemoryConfig.parse("none")], steps=2, warmup=1,
                compare_torch=True, progress=False, block=1)
print(json.dumps({"torch": out["torch"], "torch_in_parent": "torch" in sys.modules}))
"""


def test_torch_runs_in_its_own_process():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["torch_in_parent"] is False
    assert out["torch"]["process"] == "separate"
    assert out["torch"]["step_time_median_s"] > 0


def test_compare_torch_refuses_an_unpicklable_model_factory():
    from minidl.memory.ir.config import MemoryConfig
    from minidl.tools.bench import run_bench
    from minidl.zoo.models import get_model

    with pytest.raises(ValueError, match="picklable make_net"):
        run_bench(lambda: get_model("smallcnn", (1, 12, 12), 4), (1, 12, 12), 4,
                  [MemoryConfig.parse("none")], steps=1, warmup=0, compare_torch=True,
                  progress=False, block=1)


def test_cli_compare_torch_reports_the_separate_process():
    res = subprocess.run([sys.executable, "-m", "minidl", "bench", "smallcnn", "--input",
                          "1x12x12", "--batch-size", "4", "--steps", "1", "--warmup", "0",
                          "--compare-torch", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["torch"]["process"] == "separate"
