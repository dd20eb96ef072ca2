"""Inference from a compressed model: the same outputs as the decompressed network, and a
planned peak equal to the real one, below the dense weights alone."""

from __future__ import annotations

import numpy as np
import pytest

from minidl import Trainer
from minidl.compression.container import CompressedModel, CompressedModelError, to_bytes
from minidl.compression.inference import CompressedRunner, build_network, plan_inference
from minidl.compression.layer_spec import compressible_weights
from minidl.compression.pruning import magnitude_mask
from minidl.compression.quantization import share_weights
from minidl.kernels.compression import weight_record
from minidl.zoo.models import get_model


def _compressed(name: str, shape: tuple[int, ...], **kw) -> tuple[CompressedModel, object]:
    net = get_model(name, input_shape=shape, num_classes=10, **kw)
    weights = {c.param.name for c in compressible_weights(net)}
    records = {}
    for n, p in net.named_parameters(include_buffers=True):
        if n in weights:
            s = share_weights(p.data * magnitude_mask(p.data, 0.8), 4)
            p.data[...] = s.dense()
            records[n] = weight_record.shared_record(s.codes, s.codebook, 4, 3)
        else:
            records[n] = weight_record.raw_record(p.data)
    cm = CompressedModel({"name": name, "input_shape": list(shape), "num_classes": 10,
                          "width": kw.get("width")}, records)
    return cm, net


@pytest.mark.parametrize("name,shape,kw", [("lenet5", (1, 8, 8), {}),
                                           ("vgg11_bn", (1, 16, 16), {"width": 8})])
def test_outputs_equal_the_decompressed_network(name, shape, kw):
    cm, net = _compressed(name, shape, **kw)
    x = np.random.default_rng(0).normal(size=(20, *shape)).astype(np.float32)
    runner = CompressedRunner(cm)
    out = runner.predict(x, batch_size=8)  # 8, 8 and a last batch of 4
    t = Trainer(net, device_memory="64MiB")
    ref = t.predict(x, batch_size=8)
    t.close()
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("batch", [1, 3])
def test_planned_peak_is_the_real_peak_and_below_the_dense_weights(batch):
    cm, _ = _compressed("lenet5", (1, 28, 28))
    planned = plan_inference(cm, batch)
    runner = CompressedRunner(cm)
    runner.run_batch(np.zeros((batch, 1, 28, 28), np.float32))
    stats = runner.pool.stats()
    assert stats["allocated_bytes.peak"] == planned["peak_allocated_bytes"]
    assert stats["reserved_bytes.peak"] == planned["peak_reserved_bytes"]
    if batch == 1:  # (larger batches add im2col workspaces of 28x28 convolutions)
        assert planned["peak_allocated_bytes"] < planned["dense_weight_bytes"]
    decoded = {r["tensor"].rpartition(".")[0] for r in planned["live_at_peak"]
               if r["category"] == "parameter"}
    assert len(decoded) <= 1  # at most one layer's weights decoded at a time


def test_records_must_fit_the_network():
    cm, _ = _compressed("lenet5", (1, 8, 8))
    cm.records.pop("fc3.bias")
    with pytest.raises(CompressedModelError, match="not the parameters of lenet5"):
        build_network(cm)
    cm2, _ = _compressed("lenet5", (1, 8, 8))
    cm2.model["num_classes"] = 7
    with pytest.raises(CompressedModelError, match="fc3"):
        build_network(cm2)
    assert len(to_bytes(cm2)) > 0
