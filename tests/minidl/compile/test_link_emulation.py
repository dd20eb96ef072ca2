"""Link emulation: the cpu device's copy engine throttled to a target's copy/compute ratio."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import minidl
from minidl.cli import main
from minidl.compile.lowering import lower
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.cost.cost_model import simulate, step_costs
from minidl.memory.cost.link_emulation import WINDOW, LinkEmulation, compute_slowdown
from minidl.memory.cost.targets import get_target
from minidl.memory.devices.device import CopyEngine, CpuDevice
from minidl.net.optim import SGD
from minidl.zoo.models import smallcnn

#: A target whose link is slow enough next to its compute that a vDNN run stalls.
SLOW = "custom:flops=15.7T,hbm=900G,link=200M,mem=16GiB"


def _arrays(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    src = np.arange(nbytes, dtype=np.uint8)
    return np.zeros_like(src), src


# ----------------------------------------------------------------------- the throttle


def test_a_throttled_copy_takes_at_least_bytes_over_rate():
    rate, n = 20e6, 1 << 20  # 1 MiB at 20 MB/s: >= 52 ms
    dst, src = _arrays(n)
    with CopyEngine("t", bytes_per_s=rate) as eng:
        t0 = time.perf_counter()
        ev = eng.copy_async(dst, src)
        ev.wait()
        wall = time.perf_counter() - t0
        assert wall >= n / rate
        assert ev.elapsed_s >= n / rate
        np.testing.assert_array_equal(dst, src)
        # copies share the link one after another: three take three slots
        dsts = [np.zeros_like(src) for _ in range(3)]
        t0 = time.perf_counter()
        evs = [eng.copy_async(d, src) for d in dsts]
        evs[-1].wait()
        assert time.perf_counter() - t0 >= 3 * n / rate
        assert all(e.done() for e in evs)
        assert eng.busy_s >= 4 * n / rate
        assert eng.total_bytes == 4 * n


def test_the_default_engine_and_device_are_unthrottled():
    eng = CopyEngine()
    assert eng.bytes_per_s is None
    dst, src = _arrays(1 << 16)
    eng.copy_async(dst, src).wait()
    eng.synchronize()
    assert eng._stats.link_free == 0.0  # the throttle never ran
    eng.close()
    np.testing.assert_array_equal(dst, src)
    with CpuDevice("1MiB") as dev:
        assert dev.link_bytes_per_s is None and dev.copy_engine.bytes_per_s is None
        assert "link" not in repr(dev)


def test_the_device_rate_reaches_its_engine_and_bad_rates_are_refused():
    with CpuDevice("1MiB", link_bytes_per_s=5e6) as dev:
        assert dev.copy_engine.bytes_per_s == 5e6
        dev.link_bytes_per_s = 7e6  # set later: the engine follows
        assert dev.copy_engine.bytes_per_s == 7e6
        dev.link_bytes_per_s = None
        assert dev.copy_engine.bytes_per_s is None
        for bad in (0, -1.0, math.nan, math.inf):
            with pytest.raises(ValueError, match="positive finite"):
                dev.link_bytes_per_s = bad
    with pytest.raises(ValueError, match="positive finite"):
        CopyEngine(bytes_per_s=0)


# ----------------------------------------------------------------------- the rate


def _program():
    net = smallcnn(input_shape=(1, 12, 12))
    return lower(net, [(4, 1, 12, 12)], loss=SoftmaxCrossEntropy(),
                 label_shape=(4,), training=True).program


def test_slowdown_compares_forward_and_backward_steps_with_the_roofline():
    prog = _program()
    v100 = get_target("v100")
    costs = step_costs(prog, v100)
    assert compute_slowdown(prog, [3 * c for c in costs], v100) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="step times"):
        compute_slowdown(prog, costs[:-1], v100)
    emu = LinkEmulation(v100)
    assert emu.bytes_per_s is None
    assert emu.observe(prog, [9 * c for c in costs]) == pytest.approx(9.0)
    assert emu.slowdown == pytest.approx(9.0)  # the first iteration's, until others come
    for k in (2, 4, 3):  # then the median of the recent ones, the first (warm-up) left out
        emu.observe(prog, [k * c for c in costs])
    assert emu.slowdown == pytest.approx(3.0)
    assert emu.bytes_per_s == pytest.approx(12e9 / 3)
    for _ in range(WINDOW):  # the window slides: the machine got faster
        emu.observe(prog, [1.5 * c for c in costs])
    assert emu.slowdown == pytest.approx(1.5) and emu.iterations == 4 + WINDOW
    with pytest.raises(ValueError, match="step times"):
        emu.observe(prog, costs[:-1])


# ----------------------------------------------------------------------- the Trainer


def _train(steps: int, memory: str = "vdnn", **kwargs):
    net = smallcnn(input_shape=(1, 16, 16))
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=memory,
                        device_memory="64MiB", **kwargs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    losses = [tr.step(x, y) for _ in range(steps)]
    return tr, losses, {k: v.copy() for k, v in net.state_dict().items()}


def test_trainer_emulates_the_link_and_results_are_bit_identical():
    steps = 4
    ref, ref_losses, ref_state = _train(steps)
    tr, losses, state = _train(steps, emulate_link=SLOW)
    emu = tr.link_emulation
    assert emu.profile.name == "custom" and tr.engine.target is emu.profile
    assert emu.slowdown > 0 and emu.iterations == 4
    assert tr.device.link_bytes_per_s == tr.device.copy_engine.bytes_per_s == emu.bytes_per_s
    assert emu.bytes_per_s == pytest.approx(200e6 / emu.slowdown)
    assert any("cost model" in n for n in tr.last_compiled.plan.notes)
    # the throttle only changes timing: losses and weights bit for bit
    assert losses == ref_losses
    for k in ref_state:
        np.testing.assert_array_equal(state[k], ref_state[k])
    # a slow link shows: every copy took its slot, and compute waited for some
    eng = tr.device.copy_engine
    assert eng.busy_s >= tr.swap_stats["offloaded_bytes"] / emu.bytes_per_s
    assert tr.swap_stats["stall_s"] > 0
    rep = tr.memory_report()["link_emulation"]
    assert rep["target"] == "custom" and rep["slowdown"] == emu.slowdown
    assert ref.link_emulation is None and ref.device.link_bytes_per_s is None
    assert simulate(tr.last_compiled.plan, emu.profile).offloaded_bytes \
        == tr.swap_stats["offloaded_bytes"]


def test_trainer_refuses_bad_targets_and_other_devices():
    net = smallcnn(input_shape=(1, 16, 16))
    with pytest.raises(ValueError, match="unknown target 'v1000'"):
        minidl.Trainer(net, emulate_link="v1000", device_memory="16MiB")
    with pytest.raises(ValueError, match="needs device='cpu'"):
        minidl.Trainer(net, emulate_link="v100", device="meta")


# ----------------------------------------------------------------------- the command line


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_and_bench_emulate_the_link(capsys):
    code, out, _ = _run(capsys, "train", "smallcnn", "--dataset", "synthetic", "--input",
                        "1x16x16", "--batch-size", "8", "--max-steps", "4", "--memory",
                        "reuse,swap=auto", "--emulate-link", "titanx", "--json", "--no-progress")
    assert code == 0
    link = json.loads(out)["memory_report"]["link_emulation"]
    assert link["target"] == "titanx-maxwell" and link["slowdown"] > 0
    assert link["link_bytes_per_s"] == pytest.approx(12e9 / link["slowdown"])
    code, out, _ = _run(capsys, "bench", "smallcnn", "--input", "1x16x16", "--batch-size", "8",
                        "--memory", "vdnn", "--steps", "2", "--warmup", "1", "--emulate-link",
                        "v100")
    assert code == 0
    assert "v100 link emulated:" in out and "MB/s" in out


@pytest.mark.parametrize("argv, needle", [
    (["train", "smallcnn", "--emulate-link", "v1000"], "--emulate-link: unknown target"),
    (["bench", "smallcnn", "--emulate-link", "custom:flops=1T"], "custom target needs"),
    (["train", "smallcnn", "--emulate-link", "v100", "--device", "cuda-strict"],
     "needs --device cpu"),
])
def test_bad_emulate_link_is_a_one_line_usage_error(capsys, argv, needle):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1
