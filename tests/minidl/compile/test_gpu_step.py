"""A GPU training step that does not wait for the host, checked on the strict CUDA device.

The strict device counts every host synchronisation (a ``float()`` of a device array, a
``get()``, a wait on a copy or an event) and every operation issued on the compute stream:
a step asked not to wait (``Trainer.step(x, y, wait=False)``, what ``fit`` does on a GPU) makes
none, whatever the memory strategy (``sparse`` reads one count per sparse stash: its format
and size depend on it); launches per step stay bounded per step of the program.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

import minidl  # noqa: E402
from minidl import layers as L  # noqa: E402
from minidl.compile.deferred import Deferred  # noqa: E402
from minidl.compile.executor import NonFiniteError  # noqa: E402
from minidl.memory.runtime.transfer import to_host  # noqa: E402
from minidl.memory.testing.strict_device import StrictCudaDevice  # noqa: E402
from minidl.net.optim import SGD, Adam  # noqa: E402
from minidl.zoo.models import resnet, smallcnn  # noqa: E402
from minidl.zoo.rnn import char_rnn  # noqa: E402


def _images(shape, batch=4):
    def data():
        rng = np.random.default_rng(0)
        return rng.standard_normal((batch, *shape)).astype(np.float32), \
            rng.integers(0, 10, batch)
    return data


def _text():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 17, (2, 6))
    return x, np.roll(x, -1, axis=1)


MODELS = {
    "smallcnn": (lambda: smallcnn((1, 12, 12), 10, width=4), _images((1, 12, 12))),
    "resnet8": (lambda: resnet(8, (3, 8, 8), 10, width=4), _images((3, 8, 8))),
    "char-lstm": (lambda: char_rnn(17, 8, 12, num_layers=2, steps=6), _text),
}
SPECS = ["none", "reuse,inplace", "reuse,inplace,static", "vdnn", "reuse,swap=all,cache",
         "reuse,recompute=sqrt", "superneurons", "reuse,inplace,binarize", "reuse,dpr=fp16"]


def _trainer(model, spec, device=None, optimizer=SGD, **kw):
    make, data = MODELS[model]
    net = make()
    dev = device or StrictCudaDevice("64MiB")
    opt = optimizer(net.parameters(), lr=0.01) if optimizer is not SGD else \
        SGD(net.parameters(), lr=0.01, momentum=0.9)
    tr = minidl.Trainer(net, opt, memory=spec, device=dev, device_memory="64MiB", **kw)
    return tr, dev, data()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_step_that_does_not_wait_makes_no_host_synchronisation(model, spec):
    tr, dev, (x, y) = _trainer(model, spec)
    for _ in range(2):  # planning, measured re-planning, the scratch block
        tr.step(x, y)
    syncs = dev.host_syncs
    loss = tr.step(x, y, wait=False)
    assert dev.host_syncs == syncs, f"{dev.host_syncs - syncs} host synchronisations"
    assert isinstance(loss, Deferred) and not loss.ready()
    value = float(loss)  # reading it is the one synchronisation
    assert dev.host_syncs == syncs + 1 and np.isfinite(value)
    assert tr.step(x, y) == pytest.approx(tr.step(x, y), rel=0.5)  # wait=True: floats


#: Most launches one forward or backward of a layer makes (array operations that write, and
#: kernels), on these small shapes; a recurrent layer's per time step and layer. Convolutions
#: build each tile's column matrix with one kernel (not one copy per kernel tap).
LAUNCH_CEILINGS = {"Conv2d": 8, "BatchNorm2d": 4, "LSTM": 6, "SoftmaxCrossEntropy": 16}
OTHER_LAYERS = 6


@pytest.mark.parametrize("model", sorted(MODELS))
def test_launches_per_layer_are_bounded_and_the_update_is_one(model, monkeypatch):
    from collections import Counter

    from minidl.compile.executor import Executor

    tr, dev, (x, y) = _trainer(model, "reuse,inplace")
    tr.step(x, y)
    counts: Counter = Counter()

    def counting(run):
        def counted(self, st, rt, *args):
            before = dev.launches
            run(self, st, rt, *args)
            layer = self.layers[st.node]
            units = 1  # (a fused recurrent stack: per time step and layer)
            if hasattr(layer, "num_layers"):
                units = rt.program.tensors[st.forward.inputs[0]].shape[1] * layer.num_layers
            counts[(type(layer).__name__, st.phase)] = max(
                counts[(type(layer).__name__, st.phase)], (dev.launches - before) / units)
        return counted

    for name in ("_forward", "_backward"):
        monkeypatch.setattr(Executor, name, counting(getattr(Executor, name)))
    tr.step(x, y, wait=False)
    for (kind, phase), n in counts.items():
        assert n <= LAUNCH_CEILINGS.get(kind, OTHER_LAYERS), (kind, phase, n)
    before = dev.launches
    tr.optimizer.step()
    assert dev.launches - before == len(tr.optimizer.flat_groups) == 1


def test_sparse_reads_one_count_per_sparse_stash():
    tr, dev, (x, y) = _trainer("resnet8", "reuse,sparse")
    for _ in range(2):
        tr.step(x, y)
    stashes = sum(1 for st in tr.last_compiled.plan.program.steps
                  if st.phase == "encode" and st.op.codec.codec == "sparse")
    assert stashes > 0
    syncs = dev.host_syncs
    tr.step(x, y, wait=False)
    assert dev.host_syncs - syncs == stashes


def test_the_loss_asked_for_is_the_one_synchronisation():
    tr, dev, (x, y) = _trainer("smallcnn", "reuse,inplace")
    tr.step(x, y)
    syncs = dev.host_syncs
    loss = tr.step(x, y)
    assert isinstance(loss, float) and dev.host_syncs == syncs + 1


def test_cpu_steps_return_floats_either_way():
    make, data = MODELS["smallcnn"]
    x, y = data()
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01), memory="reuse", device_memory="8MiB")
    assert not tr.asynchronous
    assert isinstance(tr.step(x, y, wait=False), float)


def test_deferred_losses_equal_the_waited_ones():
    a, _, (x, y) = _trainer("resnet8", "reuse,inplace")
    b, _, _ = _trainer("resnet8", "reuse,inplace")
    waited = [a.step(x, y) for _ in range(4)]
    deferred = [b.step(x, y, wait=False) for _ in range(4)]
    assert [float(v) for v in deferred] == waited


def test_fit_waits_once_per_epoch():
    """fit on a GPU: each epoch's mean loss and accuracy (its log line) is read once, the
    newest first, so the whole epoch costs one host synchronisation beyond the first step."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((48, 20)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    net = minidl.Sequential([L.Linear(20, 16), L.ReLU(), L.Linear(16, 2)], input_shape=(20,))
    dev = StrictCudaDevice("8MiB")
    tr = minidl.Trainer(net, Adam(net.parameters(), lr=0.01), memory="reuse,swap=all",
                        device=dev, device_memory="8MiB")
    tr.fit((x, y), epochs=1, batch_size=16, progress=False, evaluate=False)  # compiles, plans
    syncs = dev.host_syncs
    hist = tr.fit((x, y), epochs=4, batch_size=16, progress=False, evaluate=False)
    assert dev.host_syncs - syncs == 3  # epochs 2, 3 and 4
    assert all(isinstance(v, float) for v in hist.losses + hist.train_accuracy)
    assert len(hist.losses) == 9


def test_a_non_finite_loss_raises_when_read():
    tr, dev, (x, y) = _trainer("smallcnn", "reuse,inplace")
    tr.step(x, y)
    for p in tr.net.parameters():  # poisoned weights: the next loss is NaN
        p.data.fill(np.nan)
    iteration = tr.iteration
    loss = tr.step(x, y, wait=False)  # no wait: nothing is known yet
    assert isinstance(loss, Deferred)
    with pytest.raises(NonFiniteError, match=f"the loss is nan at iteration {iteration}"):
        float(loss)


# ----------------------------------------------------------------------------- checks on the host
def test_out_of_range_labels_are_refused_before_the_upload():
    tr, dev, (x, y) = _trainer("smallcnn", "reuse,inplace")
    with pytest.raises(IndexError, match="target 10 out of range for 10 classes"):
        tr.step(x, np.array([0, 1, 2, 10]))
    tr2, _, (t, _) = _trainer("char-lstm", "reuse,inplace")
    with pytest.raises(IndexError, match="token 17 out of range"):
        tr2.step(np.full_like(t, 17), t)


# ----------------------------------------------------------------------------- the update
@pytest.mark.parametrize("optimizer", [SGD, Adam])
def test_the_update_and_clipping_make_no_temporary_outside_the_arena(optimizer):
    """The optimizer's and clipping's temporaries go into the arena (CuPy's default pool,
    outside it, never holds a byte: its *peak* stays 0)."""
    tr, dev, (x, y) = _trainer("resnet8", "reuse,inplace", optimizer=optimizer,
                               clip_grad_norm=0.5)
    for _ in range(3):
        tr.step(x, y)
    assert dev.default_pool_peak == 0
    assert tr.memory_report()["outside_arena"]["cupy_pool_peak"] == 0


def test_a_second_gpu_runs_everything_with_itself_current():
    """cuda:1: every operation of the step, the update and clipping included, runs while
    that device is current (the strict device refuses work issued with device 0 current)."""
    make, data = MODELS["resnet8"]
    x, y = data()
    ref, _, _ = _trainer("resnet8", "reuse,inplace", optimizer=Adam, clip_grad_norm=0.5)
    one, _, _ = _trainer("resnet8", "reuse,inplace", optimizer=Adam, clip_grad_norm=0.5,
                         device=StrictCudaDevice("64MiB", device_id=1))
    for _ in range(2):
        assert one.step(x, y) == ref.step(x, y)
    for (k, p), q in zip(one.net.named_parameters(), ref.net.parameters()):
        assert np.array_equal(to_host(p.data), to_host(q.data)), k


# ----------------------------------------------------------------------------- the scratch block
def test_evaluation_at_a_larger_batch_does_not_split_and_equals_cpu():
    """The scratch block is sized at the first training step; an evaluation at 4x the batch
    makes larger temporaries: they overflow into the pool (counted) instead of failing, so the
    batch is never halved."""
    make, data = MODELS["smallcnn"]
    x, y = data()
    rng = np.random.default_rng(3)
    xe = rng.standard_normal((16, 1, 12, 12)).astype(np.float32)
    outs = {}
    for name, dev in (("cpu", "cpu"), ("gpu", StrictCudaDevice("64MiB"))):
        net = make()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01), memory="reuse,inplace",
                            device=dev, device_memory="64MiB")
        tr.step(x, y)
        tr.step(x, y)
        outs[name] = tr.predict(xe, batch_size=16)
        assert tr.observed.eval_splits == 0
    np.testing.assert_allclose(outs["gpu"], outs["cpu"], rtol=1e-5, atol=1e-6)


def test_swap_auto_re_plans_on_the_links_measured_rate():
    """On a GPU the copy engine's events time the host link: the measured re-planning of
    swap=auto uses that rate instead of an assumed one."""
    tr, dev, (x, y) = _trainer("resnet8", "reuse,swap=auto")
    dev.copy_engine.busy_s = 1e-4  # (the strict device does not time its copies)
    # step 1 reserves the scratch block (a new compiled step), whose times count from its
    # second run (a warm one, WARM_RUNS): re-planned after step 3, run at step 4
    for _ in range(4):
        tr.step(x, y)
    notes = " ".join(tr.last_compiled.plan.notes)
    assert "measured step times and host link" in notes, notes


@pytest.mark.parametrize("model", ["smallcnn", "resnet8"])
def test_the_device_librarys_temporaries_are_small(model):
    """No feature-map-sized temporary: GEMMs write into their outputs, ReLU's backward is one
    kernel (it made a mask and a copy of the map), so the scratch block stays a few KiB."""
    tr, dev, (x, y) = _trainer(model, "reuse,inplace")
    tr.step(x, y)
    tr.step(x, y)
    largest = max(t.nbytes for t in tr.last_compiled.plan.program.tensors)
    assert tr.engine.scratch is not None and tr.engine.scratch.size <= 8 << 10 < largest
