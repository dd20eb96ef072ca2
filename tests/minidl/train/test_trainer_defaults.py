"""What the Python API's Trainer does by default for a new user: a device of the machine's
size (the CLI sizes its own from dry runs), and a line on stderr while the first steps compile
Numba kernels."""

from __future__ import annotations

import minidl
from minidl.zoo.models import smallcnn


def test_trainer_device_memory_defaults_to_what_the_machine_has():
    """The Python API's default device is the host's (not a fixed 1 GiB that larger models
    overflow); the CLI sizes its device from dry runs instead."""
    from minidl.memory.device_factory import AUTO_HOST_SHARE
    from minidl.memory.devices.device import available_host_memory

    tr = minidl.Trainer(smallcnn((1, 16, 16), 10, width=8))
    assert tr.device.capacity > 1 << 30 or \
        tr.device.capacity >= 0.9 * AUTO_HOST_SHARE * available_host_memory()
    assert minidl.Trainer(smallcnn((1, 16, 16), 10, width=8), device="meta",
                          device_memory="auto").device.capacity == 1 << 62


def test_first_steps_say_when_kernels_compile(capsys):
    """A new machine compiles Numba kernels for tens of seconds at the first step: the Python
    API says so on stderr (and how long it took), then stays silent."""
    import numba

    tr = minidl.Trainer(smallcnn((1, 16, 16), 10, width=8), device_memory="64MiB")

    @numba.njit(cache=False)
    def fresh(v):  # (never in Numba's cache: compiles inside the block)
        return v + 1

    with tr._compile_notice():
        fresh(1)
    err = capsys.readouterr().err
    assert "compiling this machine's kernels" in err and "kernels compiled in" in err
    with tr._compile_notice():
        pass
    with tr._compile_notice():
        fresh(2.0)  # (a new signature compiles, but the trainer already said it was ready)
    assert capsys.readouterr().err == ""


def test_an_evaluation_that_sets_the_peak_is_said():
    """fit evaluates at batch 256 after training at 16: the pool's peak is then the
    evaluation's, and the report and memory_summary say so instead of showing two peaks."""
    import numpy as np

    tr = minidl.Trainer(smallcnn((1, 16, 16), 10, width=8), device_memory="64MiB")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 1, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 300)
    tr.step(x[:16], y[:16])
    rep = tr.memory_report()
    assert "evaluation_peak_bytes" not in rep
    tr.evaluate(x, y, batch_size=256)
    rep = tr.memory_report()
    assert rep["evaluation_batch_size"] == 256
    assert rep["evaluation_peak_bytes"] > rep["iteration_peak_bytes"]
    assert rep["peak_allocated_bytes"] >= rep["evaluation_peak_bytes"]
    note = [n for n in rep["notes"] if "is an evaluation's" in n]
    assert note and "batch 256 in eval mode" in note[0]
    assert "is an evaluation's" in minidl.memory_summary(tr).replace("\n| ", " ")
