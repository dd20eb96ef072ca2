"""``offload=optimizer`` in mixed precision: the device keeps matrix ops' parameters only as
their half copy (the float32 master on the host), training stays bit-identical to on-device
training in the same precision, and the dry run's device and host bytes are the real run's."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.compile.engine import Engine
from minidl.compile.host_state import half_parameters
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.names import Role
from minidl.memory.ir.precision import Precision
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import Adam, AdamW
from minidl.zoo import models
from minidl.zoo.transformers import TransformerConfig, gpt

TINY = TransformerConfig(layers=2, heads=2, dim=32, context=8, vocab=11, dropout=0.1)
ON, OFF = "reuse,inplace", "reuse,inplace,offload=optimizer"
PRECISIONS = ("bf16-mixed", "fp16-mixed")


def _cnn():
    return models.smallcnn((1, 8, 8), 10, width=2)


def _gpt():
    return gpt(TINY, name="tiny-gpt")


def _resnet8():  # (batch norm: its parameters stay float32, read through half copies)
    return models.resnet(8, (3, 8, 8), 10, width=4)


def _resnet8_batch():
    rng = np.random.default_rng(1)
    return rng.standard_normal((6, 3, 8, 8)).astype(np.float32), rng.integers(0, 10, 6)


def _cnn_batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)


def _gpt_batch():
    rng = np.random.default_rng(0)
    return (rng.integers(0, TINY.vocab, (3, TINY.context)),
            rng.integers(0, TINY.vocab, (3, TINY.context)))


def _train(make, batch, spec, optimizer, precision, steps=3):
    net = make()
    try:
        tr = minidl.Trainer(net, optimizer(net.parameters(), lr=1e-2), memory=spec,
                            device_memory="32MiB", debug=True, precision=precision)
    except ValueError as e:  # (a layer the CPU does not run in mixed precision yet)
        if "supports" in str(e):
            pytest.skip(str(e))
        raise
    x, y = batch
    losses = [tr.step(x, y) for _ in range(steps)]
    rep = tr.memory_report()
    state = tr.engine.host_state
    out = (losses, {k: np.array(v) for k, v in net.state_dict().items()},
           {k: np.array(v) for k, v in tr.optimizer.state_dict().items()},
           (rep["peak_allocated_bytes"], rep["peak_reserved_bytes"],
            0 if state is None else state.nbytes), tr.engine.half_parameters)
    tr.close()
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("make,batch,optimizer", [(_cnn, _cnn_batch, Adam),
                                                  (_resnet8, _resnet8_batch, AdamW),
                                                  (_gpt, _gpt_batch, AdamW)])
def test_training_is_bit_identical_and_the_dry_run_is_the_real_run(make, batch, optimizer,
                                                                    precision):
    on_device = _train(make, batch(), ON, optimizer, precision)
    offloaded = _train(make, batch(), OFF, optimizer, precision)
    assert offloaded[4] and not on_device[4]  # half parameters under offload only
    assert offloaded[0] == on_device[0]  # losses
    for a, b in ((on_device[1], offloaded[1]), (on_device[2], offloaded[2])):
        assert a.keys() == b.keys()
        for k in a:  # master parameters (float32) and optimizer state
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    name = "adam" if optimizer is Adam else "adamw"
    x, _ = batch()
    for spec, run in ((ON, on_device), (OFF, offloaded)):
        rep = minidl.dry_run(make(), len(x), spec, name, input_shape=x.shape[1:],
                             precision=precision)
        assert (rep["peak_allocated_bytes"], rep["peak_reserved_bytes"],
                rep["host_state_bytes"]) == run[3], spec
    assert offloaded[3][0] < on_device[3][0]


def test_half_parameters_are_those_only_matrix_ops_read():
    net = _gpt()
    half = half_parameters(net, Precision.BF16_MIXED)
    trainable = {p.name for p in net.parameters()}
    assert half and half < trainable
    kinds: dict[str, set[str]] = {}
    for node in net.nodes:
        for p in net.layer_params(node.name).values():
            kinds.setdefault(p.name, set()).add(node.layer.kind)
    for name in trainable:  # the tied embedding, positions and norms stay float32
        assert (name in half) == (kinds[name] <= {"linear", "attention"}), name
    assert half_parameters(net, Precision.FP32) == frozenset()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_device_holds_half_parameters_and_no_cast_copy_of_them(precision):
    x, _ = _gpt_batch()
    plans = {}
    for spec in (ON, OFF):
        net = _gpt()
        rep = minidl.dry_run(net, len(x), spec, "adamw", precision=precision, target="v100")
        plans[spec] = rep
    on, off = plans[ON], plans[OFF]
    half_dtype = Precision.of(precision).half_dtype
    net = _gpt()
    half = half_parameters(net, Precision.of(precision))
    by_name = {p.name: p for p in net.parameters()}
    # the device keeps each half parameter in 2 bytes, the others in 4 (blocks of 512 B)
    blocks = sum(-(-by_name[n].nbytes // (2 if n in half else 1) // 512) * 512
                 for n in by_name)
    assert off["persistent_bytes"] == blocks < on["persistent_bytes"] // 4
    # the host keeps the float32 state of fp32's offload; the copy back moves the half bytes
    fp32 = minidl.dry_run(_gpt(), len(x), OFF, "adamw", target="v100")
    assert off["host_state"] == fp32["host_state"]
    assert off["host_update"]["host_update_s"] == fp32["host_update"]["host_update_s"]
    assert off["host_update"]["parameter_upload_s"] < \
        0.6 * fp32["host_update"]["parameter_upload_s"]
    assert off["peak_allocated_bytes"] < on["peak_allocated_bytes"]
    # in the program: half parameter tensors, and no "@half" stash copy of them
    net = _gpt()
    engine = Engine(net, Pool(MetaDevice()), OFF, SoftmaxCrossEntropy(),
                    AdamW(net.parameters()), bind=False, precision=precision)
    prog = engine.compiled([x.shape], x.shape, True).plan.program
    params = {t.name: t for t in prog.tensors if t.role == Role.PARAM}
    assert {n for n, t in params.items() if str(t.dtype) == half_dtype} == half
    assert not any(t.name.split("@")[0] in half for t in prog.tensors
                   if "@" in t.name and t.role == Role.STASH)
    assert all(str(t.dtype) == "float32" for t in prog.tensors if t.role == Role.PARAM_GRAD)


@pytest.mark.parametrize("spec", [OFF, "reuse,inplace,offload=parameters"])
def test_checkpoint_and_resume_keep_the_half_copies_in_step(tmp_path, spec):
    """(offload=parameters: the host's half copies, streamed in, follow the loaded masters.)"""
    x, y = _cnn_batch()
    straight = _train(_cnn, (x, y), spec, Adam, "bf16-mixed", steps=4)[0]
    net = _cnn()
    tr = minidl.Trainer(net, Adam(net.parameters(), lr=1e-2), memory=spec,
                        device_memory="32MiB", precision="bf16-mixed")
    first = [tr.step(x, y) for _ in range(2)]
    tr.save(tmp_path / "c.npz")
    tr.close()
    net2 = _cnn()
    for p in net2.parameters():  # other weights: everything must come from the checkpoint
        p.data[...] += 1
    tr2 = minidl.Trainer(net2, Adam(net2.parameters(), lr=1e-2), memory=spec,
                         device_memory="32MiB", precision="bf16-mixed")
    tr2.load(tmp_path / "c.npz", resume=True)
    assert first + [tr2.step(x, y) for _ in range(2)] == straight
    tr2.close()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("make,batch", [(_cnn, _cnn_batch), (_gpt, _gpt_batch)])
def test_evaluation_reads_the_rounded_weights_on_the_device_and_offloaded(make, batch,
                                                                           precision):
    """Inference rounds a matrix op's weights to half as training does (autocast's cast; its
    copy dies after the step), so after the same steps the on-device and the offloaded
    evaluations agree bit for bit (the offloaded device holds only the half copies)."""
    x, y = batch()
    evaluations = []
    for spec in (ON, OFF):
        net = make()
        tr = minidl.Trainer(net, AdamW(net.parameters()), memory=spec, device_memory="32MiB",
                            precision=precision, debug=True)
        for _ in range(2):
            tr.step(x, y)
        evaluations.append(tr.evaluate(x, y))
        tr.close()
    assert evaluations[0] == evaluations[1]
