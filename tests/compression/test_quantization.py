"""Weight sharing (k-means, linear init) and fine-tuning of the shared values by summed
gradients."""

from __future__ import annotations

import numpy as np

from minidl import Trainer
from minidl.compression.layer_spec import compressible_weights
from minidl.compression.quantization import ClusterOptimizer, share_weights
from minidl.net.optim import SGD
from minidl.zoo.models import get_model


def test_share_weights_keeps_zeros_and_uses_at_most_2_to_the_bits_minus_1_values():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(40, 30)).astype(np.float32)
    w[rng.random(w.shape) < 0.6] = 0
    s = share_weights(w, 3)
    assert len(s.codebook) == 7 and s.codes.max() <= 7
    assert ((s.codes == 0) == (w == 0)).all()
    d = s.dense()
    assert len(np.unique(d[d != 0])) <= 7
    # each weight went to its nearest shared value
    near = np.abs(w[w != 0][:, None] - s.codebook[None]).argmin(axis=1) + 1
    assert (near == s.codes[w != 0]).all()
    few = share_weights(np.array([0.0, 1.0, 1.0, 2.0]), 5)  # fewer distinct values than 31
    assert len(few.codebook) == 2 and few.dense().tolist() == [0.0, 1.0, 1.0, 2.0]


def test_fine_tuning_moves_centroids_by_summed_gradients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    net = get_model("lenet5", input_shape=(1, 8, 8), num_classes=10)
    shared = {}
    for c in compressible_weights(net):
        w = c.param.data.copy()
        w[np.abs(w) < np.median(np.abs(w))] = 0
        shared[c.param.name] = share_weights(w, 4)
        c.param.data[...] = shared[c.param.name].dense()
    lr = 0.05
    opt = ClusterOptimizer(net.parameters(), shared, lambda ps: SGD(ps, lr=lr))
    t = Trainer(net, opt, device_memory="16MiB")
    name = "fc1.weight"
    before = shared[name].codebook.copy()
    bias_before = net.layer_params("fc1")["bias"].data.copy()
    t.compute_gradients(x, y)
    p = dict(net.named_parameters())[name]
    codes = shared[name].codes
    expected = before - lr * np.array([p.grad[codes == j + 1].sum() for j in range(len(before))])
    opt.step()
    np.testing.assert_allclose(shared[name].codebook, expected, rtol=1e-5, atol=1e-7)
    assert (p.data == shared[name].dense()).all() and (p.data[codes == 0] == 0).all()
    assert not np.array_equal(net.layer_params("fc1")["bias"].data, bias_before)  # trained too
    t.close()
