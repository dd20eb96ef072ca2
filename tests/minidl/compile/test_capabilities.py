"""Memory passes act on declared capabilities, never on layer names or kinds."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.compile.lowering import lower
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.ir.capabilities import OpCaps, RecomputeCost, StashEncoding, op_caps


def _program(net, shape, **kw):
    return lower(net, [shape], loss=SoftmaxCrossEntropy(), label_shape=shape[:1], **kw).program


class Rectifier(L.ReLU):
    """A ReLU under another name and kind: what it declares is all memory sees."""

    kind = "my_rectifier"


class Opaque(L.ReLU):
    """A ReLU that declares nothing: no pass may encode its output."""

    kind = "relu"  # the old name-based passes would have matched this
    backward_from = ()
    sparse_output = False


def _net(act):
    return minidl.Sequential([L.Conv2d(1, 4, 3, padding=1), act(), L.MaxPool2d(2), L.Flatten(),
                              L.Linear(4 * 4 * 4, 3)], input_shape=(1, 8, 8), seed=1)


def test_steps_carry_the_declared_capabilities():
    prog = _program(_net(L.ReLU), (2, 1, 8, 8))
    caps = {s.layer: s.op.caps for s in prog.steps if s.phase == "forward"}
    conv, relu, pool, _, fc, loss = caps.values()
    assert conv == OpCaps(RecomputeCost.EXPENSIVE, convolution=True,
                          options=frozenset({"device_kind", "conv_ws"}))  # workspace per
    # kind, and under a cap (memory/options/workspace_options.py)
    assert relu == OpCaps(backward_from=frozenset({StashEncoding.SIGN}), sparse_output=True)
    assert pool.backward_from == frozenset({StashEncoding.PACKED_ARGMAX})
    assert fc.cost is RecomputeCost.EXPENSIVE
    assert loss == OpCaps(options=frozenset({"device_kind"}))  # (its kernels' workspace on a GPU)


@pytest.mark.parametrize("act, encoded", [(Rectifier, True), (Opaque, False)])
def test_binarize_follows_capabilities_not_names(act, encoded):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 2)
    net = _net(act)
    tr = minidl.Trainer(net, memory="reuse,binarize", device_memory="16MiB")
    tr.compute_gradients(x, y)
    summary = tr.last_compiled.plan.program.rewrites.compression
    enc = {} if summary is None else summary.encoded
    names = {type(n.layer): n.name for n in net.nodes}
    assert (names[act] in enc) is encoded, enc
    assert enc[f"{names[L.MaxPool2d]}.argmax"] == "poolidx"
    # backward from the encodings gives the unencoded run's gradients, bit for bit
    ref = _net(act)
    minidl.Trainer(ref, memory="none", device_memory="16MiB").compute_gradients(x, y)
    for (n, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert np.array_equal(p.grad, q.grad), n


def test_an_unknown_capability_fails_at_plan_time():
    class Weird(L.ReLU):
        recompute_cost = "sometimes"

    net = minidl.Sequential([L.Flatten(), Weird(), L.Linear(4, 2)], input_shape=(4,))
    with pytest.raises(ValueError, match="unknown recompute cost 'sometimes'; valid: cheap"):
        minidl.dry_run(net, 2, "reuse")

    class Weirder(L.ReLU):
        backward_from = ("sign", "zip")

    net = minidl.Sequential([L.Flatten(), Weirder(), L.Linear(4, 2)], input_shape=(4,))
    with pytest.raises(ValueError, match="unknown stash encoding 'zip'"):
        minidl.dry_run(net, 2, "reuse")


def test_op_caps_vocabulary():
    assert op_caps("x", "sequence", ("packed_argmax",)) == OpCaps(
        RecomputeCost.SEQUENCE, frozenset({StashEncoding.PACKED_ARGMAX}))
    with pytest.raises(ValueError, match="layer y: unknown recompute cost"):
        op_caps("layer y", "free")


def test_recompute_keeps_what_is_declared_expensive():
    class CheapLinear(L.Linear):
        recompute_cost = "cheap"

    def build(lin):
        return minidl.Sequential([L.Flatten(), lin(16, 16), L.ReLU(), lin(16, 16), L.ReLU(),
                                  lin(16, 3)], input_shape=(16,), seed=0)

    from minidl.memory.passes.recompute import choose_checkpoints

    kept = {}
    for lin in (L.Linear, CheapLinear):
        prog = _program(build(lin), (2, 16))
        names = {t.id: t.name for t in prog.tensors}
        kept[lin] = {names[t] for t in choose_checkpoints(prog, "speed")}
    assert kept[L.Linear] == {"1", "3", "5"}  # the three linear layers' outputs
    assert kept[CheapLinear] == set()
