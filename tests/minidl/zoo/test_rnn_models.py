"""Unrolled RNN models through the engine: PyTorch parity, strategies bit-identical, new
sequence lengths, bad input."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.net.optim import SGD
from minidl.zoo.rnn import char_rnn


def _batch(v=11, n=3, t=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, v, (n, t)), rng.integers(0, v, (n, t))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_char_rnn_matches_pytorch(cell):
    torch = pytest.importorskip("torch")
    from minidl.interop.torch_bridge import to_torch

    net = char_rnn(11, 6, 7, 2, steps=5, cell=cell)
    x, y = _batch()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.0), device_memory="8MiB")
    loss = tr.compute_gradients(x, y)
    tm = to_torch(net)
    out = tm(torch.from_numpy(x))
    tl = torch.nn.functional.cross_entropy(out.reshape(-1, 11), torch.from_numpy(y).reshape(-1))
    tl.backward()
    assert abs(loss - float(tl.detach())) < 1e-5
    for name, p in net.named_parameters():
        g = dict(tm.named_parameters())[name].grad.numpy()
        np.testing.assert_allclose(p.grad, g, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("spec", ["reuse,inplace", "reuse,swap=all", "reuse,recompute=speed",
                                  "reuse,recompute=memory", "reuse,inplace,static"])
def test_char_lstm_strategies_bit_identical_and_dry_run_exact(spec):
    x, y = _batch(t=6)
    runs = {}
    for s in ("none", spec):
        net = char_rnn(11, 6, 7, 2, steps=6)
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9), memory=s,
                            device_memory="8MiB", debug=True)
        losses = [tr.step(x, y) for _ in range(3)]
        runs[s] = (losses, {n: np.array(p.grad) for n, p in net.named_parameters()}, tr)
    assert runs[spec][0] == runs["none"][0]
    for n, g in runs["none"][1].items():
        assert np.array_equal(runs[spec][1][n], g), n
    rep = minidl.dry_run(char_rnn(11, 6, 7, 2, steps=6), 3, spec, input_shape=(6,))
    assert rep["peak_allocated_bytes"] == runs[spec][2].memory_report()["peak_allocated_bytes"]


def test_other_sequence_lengths_get_their_own_plan_and_bad_tokens_are_refused():
    net = char_rnn(11, 6, 7, 1, steps=4)
    tr = minidl.Trainer(net, device_memory="8MiB")
    for t in (4, 9, 2):
        x, y = _batch(t=t)
        assert np.isfinite(tr.step(x, y))
    x, y = _batch(t=4)
    x[0, 0] = 11
    with pytest.raises(IndexError, match="11"):
        tr.step(x, y)
    with pytest.raises(ValueError, match="empty sequence"):
        tr.step(np.zeros((3, 0), np.int64), np.zeros((3, 0), np.int64))
    with pytest.raises(TypeError, match="integer"):
        tr.step(np.zeros((3, 4), np.float32), y)
