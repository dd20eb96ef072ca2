"""The smallest budget ``auto`` reaches, without and with convolution workspace caps
(memory/options/workspace_options.py), on the meta device (no compute: seconds per model):

    python benchmarks/plans/lean_workspace.py          # vgg16 224 b64, alexnet 224 b128
    python benchmarks/plans/lean_workspace.py vgg16    # one of them

For each case: the smallest peak the planner reaches (from its ``BudgetTooSmall`` at a 1-byte
budget: micro-batches, swaps, recomputation and, with caps, the least workspaces), then a plan
at exactly that budget, whose dry-run peak must fit it, and its notes.
"""
from __future__ import annotations

import re
import sys

from minidl.compile.engine import Engine
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.planners.auto import BelowFloor, BudgetTooSmall
from minidl.memory.runtime.pool import Pool
from minidl.net.labels import default_label_shape
from minidl.net.optim import make_optimizer
from minidl.zoo.models import get_model

#: ResNets are left out: their greedy walk ends at auto's 20 s search limit, so the smallest
#: budget depends on the machine's load (a plan at the reported budget may not be found again).
CASES = {"vgg16": ((3, 224, 224), 64, 1000), "alexnet": ((3, 224, 224), 128, 1000)}


def _engine(model: str, spec: str, caps: bool) -> tuple[Engine, tuple, tuple]:
    shape, batch, classes = CASES[model]
    net = get_model(model, shape, classes)
    eng = Engine(net, Pool(MetaDevice()), spec, SoftmaxCrossEntropy(),
                 make_optimizer("sgd", net.parameters()), bind=False)
    eng.cap_workspaces = caps
    full = (batch, *shape)
    return eng, full, tuple(default_label_shape(net, full))


def smallest(model: str, caps: bool) -> int:
    """The least peak the auto planner reaches: a 1-byte budget is refused at once with the
    floor of every plan (BelowFloor); at the floor, the search's refusal names the least peak
    it reached (or the floor itself fits)."""
    budget = 1
    for _ in range(2):
        eng, full, labels = _engine(model, f"auto,budget={budget}", caps)
        try:
            eng.split_for([full], labels)
        except BelowFloor as e:
            budget = e.floor.bytes
            continue
        except BudgetTooSmall as e:
            return int(re.search(r"reaches is ([\d,]+) B", str(e)).group(1).replace(",", ""))
        return budget
    raise AssertionError("refused at the floor as under it")


def plan_at(model: str, budget: int, caps: bool) -> dict:
    """The dry run at ``budget``: split, peaks, notes."""
    eng, full, labels = _engine(model, f"auto,budget={budget}", caps)
    k = eng.split_for([full], labels)
    micro = -(-full[0] // k)
    c = eng.compiled([(micro, *full[1:])], (micro, *labels[1:]), True, accumulate=k > 1)
    c.executor.run([None, None], record=True)
    stats = eng.pool.stats()
    return {"split": k, "peak": stats["allocated_bytes.peak"],
            "reserved": stats["reserved_bytes.peak"],
            "persistent": c.lowered.program.persistent_bytes(), "notes": list(c.plan.notes)}


def main(models: list[str]) -> None:
    for model in models:
        shape, batch, _ = CASES[model]
        print(f"## {model} {'x'.join(map(str, shape))} batch {batch}")
        rows = {}
        for caps in (False, True):
            low = smallest(model, caps)
            r = plan_at(model, low, caps)
            assert r["peak"] <= low, (model, caps, r["peak"], low)
            rows[caps] = (low, r)
            tag = "with caps   " if caps else "without caps"
            print(f"{tag}: smallest budget {low:,} B ({low / 2**20:.1f} MiB; iteration "
                  f"{(low - r['persistent']) / 2**20:.1f} MiB above {r['persistent'] / 2**20:.1f}"
                  f" MiB persistent); at it: split {r['split']}, peak {r['peak']:,} B, "
                  f"reserved {r['reserved']:,} B")
            for n in r["notes"]:
                print(f"    {n}")
        (a, ra), (b, rb) = rows[False], rows[True]
        print(f"=> {a - b:,} B less ({(a - b) / 2**20:.1f} MiB; the iteration's part "
              f"{(a - ra['persistent']) / 2**20:.1f} -> {(b - rb['persistent']) / 2**20:.1f} "
              f"MiB)\n")


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
