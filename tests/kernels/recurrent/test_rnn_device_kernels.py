"""The LSTM / GRU cell kernels for device arrays (minidl.kernels.recurrent.rnn_device).

* Emulated launches (one host thread, ``CUDA_LAUNCH_CASES``; test_cuda_ptx.py compiles every
  signature they launch to PTX): every kernel, both float dtypes, both layouts of the
  recurrent product, every bias / carry / direct-path option, against the Numba CPU kernels
  of minidl.kernels.recurrent.rnn (same formulas; the activations differ in the last bits).
* The Numba CUDA simulator: many threads, each over several grid-stride steps.
* The fused LSTM / GRU stack on the strict CUDA device: launches per time step and layer
  (<= 4 forward, <= 6 backward) and no host synchronisation, keeping everything and under a
  recomputing BPTT schedule; the per-step cell layers' dispatch to the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
from emulated_arrays import D, H

from minidl.kernels import _cuda
from minidl.kernels.recurrent import rnn as rk
from minidl.kernels.recurrent import rnn_device as rd

#: (N, H): single elements, odd sizes, more work than one block of threads
SHAPES = [(1, 1), (3, 5), (7, 33)]
DTYPES = (np.float32, np.float64)
TOL = {np.float32: dict(rtol=2e-6, atol=1e-6), np.float64: dict(rtol=1e-13, atol=1e-14)}


def close(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    np.testing.assert_allclose(got, want, err_msg=what, **TOL[want.dtype.type])


def _normal(rng: np.random.Generator, *shape: int, dtype=np.float32, scale: float = 1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _garbage(*shape: int, dtype) -> np.ndarray:
    return np.full(shape, np.nan, dtype)


def _lstm_gates(rng, n, h, dt) -> np.ndarray:
    """Activated gates as a forward writes them: i, f, o in (0, 1), g in (-1, 1)."""
    g = rng.uniform(0.02, 0.98, (n, 4 * h)).astype(dt)
    g[:, 2 * h:3 * h] = rng.uniform(-0.98, 0.98, (n, h))
    return g


def _gru_stash(rng, n, h, dt) -> np.ndarray:
    st = np.empty((n, 4 * h), dt)
    st[:, :2 * h] = rng.uniform(0.02, 0.98, (n, 2 * h))
    st[:, 2 * h:3 * h] = rng.uniform(-0.98, 0.98, (n, h))
    st[:, 3 * h:] = rng.standard_normal((n, h))
    return st


# ----------------------------------------------------------------------------- cases
def case_lstm_forward(rng: np.random.Generator) -> None:
    """Row-major and gate-major products; no bias, one, or two (added as b_ih + b_hh)."""
    for n, h in SHAPES:
        for dt in DTYPES:
            hw = _normal(rng, n, 4 * h, dtype=dt, scale=2)
            gx = _normal(rng, n, 4 * h, dtype=dt, scale=2)
            b_a, b_b = _normal(rng, 4 * h, dtype=dt), _normal(rng, 4 * h, dtype=dt)
            c_prev = _normal(rng, n, h, dtype=dt)
            for terms in (0, 1, 2):
                bias = [np.zeros(4 * h, dt), b_a, b_a + b_b][terms]
                want = [_garbage(n, 4 * h, dtype=dt), _garbage(n, h, dtype=dt),
                        _garbage(n, h, dtype=dt)]
                rk.lstm_cell_forward(np.ascontiguousarray(hw.T), gx, bias, c_prev, *want)
                for gate_major in (False, True):
                    got = [D(_garbage(*w.shape, dtype=dt)) for w in want]
                    rd.lstm_forward_device(
                        D(np.ascontiguousarray(hw.T) if gate_major else hw), D(gx),
                        D(b_a) if terms else None, D(b_b) if terms == 2 else None,
                        D(c_prev), *got, gate_major=gate_major)
                    for name, g, w in zip(("gates", "h", "c"), got, want):
                        close(H(g), w, f"lstm forward {name} {terms} {gate_major}")


def case_lstm_backward(rng: np.random.Generator) -> None:
    """With and without the carried dh; dc_prev written in place over dc, or not at all."""
    for n, h in SHAPES:
        for dt in DTYPES:
            gates, c, c_prev = _lstm_gates(rng, n, h, dt), _normal(rng, n, h, dtype=dt), \
                _normal(rng, n, h, dtype=dt)
            dh, carry, dc = (_normal(rng, n, h, dtype=dt) for _ in range(3))
            for with_carry in (False, True):
                dh_total = dh + carry if with_carry else dh
                dg_want, dcp_want = _garbage(n, 4 * h, dtype=dt), _garbage(n, h, dtype=dt)
                rk.lstm_cell_backward(dh_total, dc, gates, c, c_prev, dg_want, dcp_want,
                                      np.empty(4 * h, dt))
                for in_place in (True, False):
                    dg, ddc = D(_garbage(n, 4 * h, dtype=dt)), D(dc)
                    rd.lstm_backward_device(D(dh), D(carry) if with_carry else None, ddc,
                                            D(gates), D(c), D(c_prev), dg,
                                            ddc if in_place else None)
                    close(H(dg), dg_want, "lstm dgates")
                    if in_place:
                        close(H(ddc), dcp_want, "lstm dc_prev")
                    else:
                        assert np.array_equal(H(ddc), dc)


def case_gru_forward(rng: np.random.Generator) -> None:
    """b_ih added to the projection and b_hh to the product, each optional; both layouts."""
    for n, h in SHAPES:
        for dt in DTYPES:
            hw = _normal(rng, n, 3 * h, dtype=dt, scale=2)
            gx = _normal(rng, n, 3 * h, dtype=dt, scale=2)
            b_ih, b_hh = _normal(rng, 3 * h, dtype=dt), _normal(rng, 3 * h, dtype=dt)
            h_prev = _normal(rng, n, h, dtype=dt)
            for has_ih, has_hh in ((False, False), (True, False), (False, True), (True, True)):
                want = [_garbage(n, 4 * h, dtype=dt), _garbage(n, h, dtype=dt)]
                rk.gru_cell_forward(gx + b_ih if has_ih else gx, np.ascontiguousarray(hw.T),
                                    b_hh if has_hh else np.zeros(3 * h, dt), h_prev, *want)
                for gate_major in (False, True):
                    got = [D(_garbage(n, 4 * h, dtype=dt)), D(_garbage(n, h, dtype=dt))]
                    rd.gru_forward_device(
                        D(gx), D(b_ih) if has_ih else None,
                        D(np.ascontiguousarray(hw.T) if gate_major else hw),
                        D(b_hh) if has_hh else None, D(h_prev), *got, gate_major=gate_major)
                    close(H(got[0]), want[0], "gru stash")
                    close(H(got[1]), want[1], "gru h")


def case_gru_backward(rng: np.random.Generator) -> None:
    """The carried dh, the next step's direct path read in, this step's written out (over the
    incoming gradient, as the fused layers do), or none of them (the cell layers)."""
    for n, h in SHAPES:
        for dt in DTYPES:
            st, h_prev = _gru_stash(rng, n, h, dt), _normal(rng, n, h, dtype=dt)
            dh, carry, direct = (_normal(rng, n, h, dtype=dt) for _ in range(3))
            for with_carry, with_direct, write in ((False, False, False), (True, False, True),
                                                    (True, True, True), (True, True, False)):
                carried = (carry + direct if with_direct else carry) if with_carry else None
                dh_total = dh if carried is None else dh + carried
                want = [_garbage(n, 3 * h, dtype=dt), _garbage(n, 3 * h, dtype=dt)]
                rk.gru_cell_backward(dh_total, st, h_prev, *want, np.empty(3 * h, dt))
                ddh = D(dh)
                got = [D(_garbage(n, 3 * h, dtype=dt)), D(_garbage(n, 3 * h, dtype=dt))]
                rd.gru_backward_device(ddh, D(carry) if with_carry else None,
                                       D(direct) if with_direct else None, D(st), D(h_prev),
                                       *got, ddh if write else None)
                close(H(got[0]), want[0], "gru dgx")
                close(H(got[1]), want[1], "gru dgh")
                if write:
                    close(H(ddh), dh_total * st[:, h:2 * h], "gru direct path")
                else:
                    assert np.array_equal(H(ddh), dh)


def case_gru_add_direct(rng: np.random.Generator) -> None:
    for n, h in SHAPES:
        for dt in DTYPES:
            acc, dh, st = _normal(rng, n, h, dtype=dt), _normal(rng, n, h, dtype=dt), \
                _gru_stash(rng, n, h, dt)
            want = acc.copy()
            rk.gru_add_direct(want, dh, st)
            got = D(acc)
            rd.gru_add_direct_device(got, D(dh), D(st))
            assert np.array_equal(H(got), want)  # one product, one sum: the same bits


CASES = {"lstm_forward": case_lstm_forward, "lstm_backward": case_lstm_backward,
         "gru_forward": case_gru_forward, "gru_backward": case_gru_backward,
         "gru_add_direct": case_gru_add_direct}
#: What test_cuda_ptx.py compiles.
CUDA_LAUNCH_CASES = CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernels_agree_with_the_cpu_kernels(name):
    CASES[name](np.random.default_rng(0))


def test_fused_step_sequence_equals_the_cpu_recurrence():
    """Three GRU backward steps chained as the fused layer chains them on a device (the
    direct path through the incoming gradient, the carry from the product) against the CPU
    sequence (cell backward, product, direct path added to the carry)."""
    rng = np.random.default_rng(3)
    n, h, steps = 4, 6, 3
    w = _normal(rng, 3 * h, h)
    st = [_gru_stash(rng, n, h, np.float32) for _ in range(steps)]
    hp = [_normal(rng, n, h) for _ in range(steps)]
    din = [_normal(rng, n, h) for _ in range(steps)]
    carry = np.zeros((n, h), np.float32)
    want = []
    for s in range(steps - 1, -1, -1):
        dh = din[s] + carry
        dgx, dgh = np.empty((n, 3 * h), np.float32), np.empty((n, 3 * h), np.float32)
        rk.gru_cell_backward(dh, st[s], hp[s], dgx, dgh, np.empty(3 * h, np.float32))
        carry = dgh @ w
        rk.gru_add_direct(carry, dh, st[s])
        want.append(dgh)
    dd = D(np.stack(din))
    dcarry = np.zeros((n, h), np.float32)
    for s in range(steps - 1, -1, -1):
        dgx, dgh = D(np.empty((n, 3 * h), np.float32)), D(np.empty((n, 3 * h), np.float32))
        rd.gru_backward_device(dd[s], D(dcarry), dd[s + 1] if s + 1 < steps else None,
                               D(st[s]), D(hp[s]), dgx, dgh, dd[s])
        close(H(dgh), want[steps - 1 - s], f"step {s}")
        dcarry = H(dgh) @ w
    close(dcarry + H(dd[0]), carry, "gradient into the initial state")


# ----------------------------------------------------------------------------- simulator
SIM_SCRIPT = """
import numpy as np
from numba import config, cuda
from minidl.kernels import _cuda
from minidl.kernels.recurrent import rnn as rk
from minidl.kernels.recurrent import rnn_device as rd
assert config.ENABLE_CUDASIM and _cuda.grid(10**6) == (4, 32)
rng = np.random.default_rng(0)
D, H = cuda.to_device, (lambda a: a.copy_to_host())
n, h = 5, 37  # 185 units of work for 128 threads: several grid-stride steps each
for dt in (np.float32, np.float64):
    tol = dict(rtol=2e-6, atol=1e-6) if dt == np.float32 else dict(rtol=1e-12, atol=1e-14)
    f = lambda *s: rng.standard_normal(s).astype(dt)
    hw, gx, b1, b2, cp = f(n, 4 * h), f(n, 4 * h), f(4 * h), f(4 * h), f(n, h)
    want = [np.empty((n, 4 * h), dt), np.empty((n, h), dt), np.empty((n, h), dt)]
    rk.lstm_cell_forward(np.ascontiguousarray(hw.T), gx, b1 + b2, cp, *want)
    got = [D(np.zeros_like(w)) for w in want]
    rd.lstm_forward_device(D(hw), D(gx), D(b1), D(b2), D(cp), *got, gate_major=False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(H(g), w, **tol)
    gates, c = want[0], want[2]
    dh, carry, dc = f(n, h), f(n, h), f(n, h)
    dg_want, dcp_want = np.empty((n, 4 * h), dt), np.empty((n, h), dt)
    rk.lstm_cell_backward(dh + carry, dc, gates, c, cp, dg_want, dcp_want, np.empty(4 * h, dt))
    dg, ddc = D(np.zeros((n, 4 * h), dt)), D(dc)
    rd.lstm_backward_device(D(dh), D(carry), ddc, D(gates), D(c), D(cp), dg, ddc)
    np.testing.assert_allclose(H(dg), dg_want, **tol)
    np.testing.assert_allclose(H(ddc), dcp_want, **tol)

    hw, gx, bi, bh, hp = f(n, 3 * h), f(n, 3 * h), f(3 * h), f(3 * h), f(n, h)
    st_want, h_want = np.empty((n, 4 * h), dt), np.empty((n, h), dt)
    rk.gru_cell_forward(gx + bi, np.ascontiguousarray(hw.T), bh, hp, st_want, h_want)
    st, hh = D(np.zeros((n, 4 * h), dt)), D(np.zeros((n, h), dt))
    rd.gru_forward_device(D(gx), D(bi), D(np.ascontiguousarray(hw.T)), D(bh), D(hp), st, hh,
                          gate_major=True)
    np.testing.assert_allclose(H(st), st_want, **tol)
    np.testing.assert_allclose(H(hh), h_want, **tol)
    dh, carry, direct = f(n, h), f(n, h), f(n, h)
    total = dh + (carry + direct)
    dgx_want, dgh_want = np.empty((n, 3 * h), dt), np.empty((n, 3 * h), dt)
    rk.gru_cell_backward(total, st_want, hp, dgx_want, dgh_want, np.empty(3 * h, dt))
    ddh, dgx, dgh = D(dh), D(np.zeros((n, 3 * h), dt)), D(np.zeros((n, 3 * h), dt))
    rd.gru_backward_device(ddh, D(carry), D(direct), D(st_want), D(hp), dgx, dgh, ddh)
    np.testing.assert_allclose(H(dgx), dgx_want, **tol)
    np.testing.assert_allclose(H(dgh), dgh_want, **tol)
    np.testing.assert_allclose(H(ddh), total * st_want[:, h:2 * h], **tol)
    acc = f(n, h)
    dacc = D(acc)
    rd.gru_add_direct_device(dacc, D(dh), D(st_want))
    rk.gru_add_direct(acc, dh, st_want)
    np.testing.assert_allclose(H(dacc), acc, **tol)
print("SIM OK")
"""


def test_kernels_under_the_simulator():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SIM_SCRIPT)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "SIM OK" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- strict device
def _strict_trainer(cell: str, spec: str):
    pytest.importorskip("cupy")
    import minidl
    from minidl.memory.testing.strict_device import StrictCudaDevice
    from minidl.net.optim import SGD
    from minidl.zoo.rnn import char_rnn

    net = char_rnn(17, 8, 12, num_layers=2, steps=6, cell=cell)
    dev = StrictCudaDevice("64MiB")
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                        device=dev, device_memory="64MiB")
    return tr, dev


#: (memory spec, sequence length): everything kept (one 6-step unit), and a recomputing
#: schedule (3 units of 16 steps, 2 stored states: backward recomputes every unit)
SCHEDULES = [("reuse,inplace", 6), ("reuse,inplace,bptt=2", 48)]


@pytest.mark.parametrize("spec,steps", SCHEDULES, ids=["keep_all", "bptt2"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_stack_launches_per_step_and_layer(cell, spec, steps, monkeypatch):
    from minidl.compile.executor import Executor

    tr, dev = _strict_trainer(cell, spec)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, (2, steps))
    y = np.roll(x, -1, axis=1)
    for _ in range(2):  # planning, measured re-planning, the scratch block
        tr.step(x, y)
    per_step: dict = {}
    kernels: Counter = Counter()

    def counting(run):
        def counted(self, st, rt, *args):
            before = dev.launches
            run(self, st, rt, *args)
            layer = self.layers[st.node]
            if hasattr(layer, "num_layers"):  # the fused stack: per time step and layer
                units = rt.program.tensors[st.forward.inputs[0]].shape[1] * layer.num_layers
                per_step[st.phase] = (dev.launches - before) / units
        return counted

    for name in ("_forward", "_backward"):
        monkeypatch.setattr(Executor, name, counting(getattr(Executor, name)))
    emulate = _cuda.Kernel.emulate
    monkeypatch.setattr(_cuda.Kernel, "emulate", lambda self, *a: (
        kernels.update([self.py_func.__name__]), emulate(self, *a)))
    syncs = dev.host_syncs
    tr.step(x, y, wait=False)
    assert dev.host_syncs == syncs, f"{dev.host_syncs - syncs} host synchronisations"
    assert per_step["forward"] <= 4 and per_step["backward"] <= 6, per_step
    cell_steps = 2 * steps  # time steps x layers
    recomputed = cell_steps if "bptt" in spec else 0  # each unit once more, in backward
    cell_kernels = {k: v for k, v in kernels.items() if k.startswith(f"_k_{cell}")}
    assert cell_kernels == {f"_k_{cell}_fwd": cell_steps + recomputed,
                            f"_k_{cell}_bwd": cell_steps}, kernels
    assert dev.default_pool_peak == 0


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_recomputing_schedule_on_the_device_equals_cpu(cell):
    """bptt=2 over 3 units on the strict device (each unit recomputed in backward) against
    the CPU's run of the same steps."""
    pytest.importorskip("cupy")
    import minidl
    from minidl.memory.runtime.transfer import to_host
    from minidl.net.optim import SGD
    from minidl.zoo.rnn import char_rnn

    rng = np.random.default_rng(1)
    x = rng.integers(0, 17, (2, 40))
    y = np.roll(x, -1, axis=1)
    from minidl.memory.testing.strict_device import StrictCudaDevice

    runs = []
    for device in ("cpu", StrictCudaDevice("64MiB")):
        net = char_rnn(17, 8, 12, num_layers=2, steps=6, cell=cell)
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05), memory="reuse,bptt=2",
                            device=device, device_memory="64MiB")
        losses = [tr.step(x, y) for _ in range(2)]
        runs.append((losses, {k: to_host(p.grad) for k, p in net.named_parameters()}))
    (cpu_losses, cpu_grads), (dev_losses, dev_grads) = runs
    np.testing.assert_allclose(dev_losses, cpu_losses, rtol=1e-5)
    for k, g in cpu_grads.items():
        np.testing.assert_allclose(dev_grads[k], g, rtol=1e-5,
                                   atol=1e-5 * np.abs(g).max() + 1e-7, err_msg=k)


def test_cell_dispatchers_send_device_arrays_to_the_kernels():
    """kernels.rnn's cell functions (the per-step cell layers') on strict device arrays:
    one kernel launch per call (plus one column sum for the bias gradient in backward)."""
    pytest.importorskip("cupy")
    from minidl.memory.testing.strict_device import StrictCudaDevice

    dev = StrictCudaDevice("1MiB")
    offset = [0]

    def put(a: np.ndarray):
        v = dev.view(offset[0], a.nbytes, a.shape, a.dtype)
        offset[0] += -(-a.nbytes // 256) * 256
        v.set(a)
        return v

    rng = np.random.default_rng(5)
    n, h = 3, 4
    hw_t, gx, bias, cp = _normal(rng, 4 * h, n), _normal(rng, n, 4 * h), _normal(rng, 4 * h), \
        _normal(rng, n, h)
    want = [np.empty((n, 4 * h), np.float32), np.empty((n, h), np.float32),
            np.empty((n, h), np.float32)]
    rk.lstm_cell_forward(hw_t, gx, bias, cp, *want)
    got = [put(np.zeros_like(w)) for w in want]
    before = dev.launches
    rk.lstm_cell_forward(put(hw_t), put(gx), put(bias), put(cp), *got)
    assert dev.launches - before == 1
    for g, w in zip(got, want):
        close(g.get(), w)
    dh, dc = _normal(rng, n, h), _normal(rng, n, h)
    bw = [np.empty((n, 4 * h), np.float32), np.empty((n, h), np.float32),
          np.empty(4 * h, np.float32)]
    rk.lstm_cell_backward(dh, dc, want[0], want[2], cp, *bw)
    dbw = [put(np.zeros_like(w)) for w in bw]
    before = dev.launches
    rk.lstm_cell_backward(put(dh), put(dc), got[0], got[2], put(cp), *dbw)
    assert dev.launches - before == 2
    for g, w in zip(dbw, bw):
        np.testing.assert_allclose(g.get(), w, rtol=1e-5, atol=1e-6)

    hw_t, gx, bias, hp = _normal(rng, 3 * h, n), _normal(rng, n, 3 * h), _normal(rng, 3 * h), \
        _normal(rng, n, h)
    st, hh = np.empty((n, 4 * h), np.float32), np.empty((n, h), np.float32)
    rk.gru_cell_forward(gx, hw_t, bias, hp, st, hh)
    dst, dhh = put(np.zeros_like(st)), put(np.zeros_like(hh))
    rk.gru_cell_forward(put(gx), put(hw_t), put(bias), put(hp), dst, dhh)
    close(dst.get(), st)
    close(dhh.get(), hh)
    bw = [np.empty((n, 3 * h), np.float32), np.empty((n, 3 * h), np.float32),
          np.empty(3 * h, np.float32)]
    rk.gru_cell_backward(dh, st, hp, *bw)
    dbw = [put(np.zeros_like(w)) for w in bw]
    ddh = put(dh)
    rk.gru_cell_backward(ddh, dst, put(hp), *dbw)
    for g, w in zip(dbw, bw):
        np.testing.assert_allclose(g.get(), w, rtol=1e-5, atol=1e-6)
    assert np.array_equal(ddh.get(), dh)  # the incoming gradient is left alone
    acc = _normal(rng, n, h)
    dacc = put(acc)
    rk.gru_add_direct(dacc, ddh, dst)
    rk.gru_add_direct(acc, dh, st)
    close(dacc.get(), acc)
