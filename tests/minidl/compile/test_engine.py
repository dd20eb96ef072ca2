"""The engine end to end: graph building, lowering, execution, dry runs, checkpoints, errors."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.net.optim import SGD


def _residual_concat_net(dtype="float64", seed=0):
    """Two inputs, fan-out, add and concat; smooth activations so finite differences are exact."""
    x = minidl.Input((6,), dtype=dtype, name="x")
    z = minidl.Input((3,), dtype=dtype, name="z")
    a = L.Linear(6, 5)(x)
    b = L.Tanh()(a)
    c = L.Linear(5, 5)(b)
    s = L.Add()(b, c)  # b fans out to c, s and d
    d = L.Concat(axis=1)(s, b, z)
    e = L.Sigmoid()(L.Linear(13, 4)(d))
    out = L.Linear(4, 3)(e)
    return minidl.Network([x, z], out, seed=seed, dtype=dtype)


def _finite_difference_check(trainer, feeds, y, eps=1e-6, tol=1e-6):
    loss = trainer.compute_gradients(feeds, y)
    assert np.isfinite(loss)
    for name, p in trainer.net.named_parameters():
        analytic = np.array(p.grad, copy=True)
        numeric = np.zeros_like(analytic)
        flat = p.data.reshape(-1)
        for i in range(flat.size):
            old = flat[i]
            flat[i] = old + eps
            lp = trainer.compute_gradients(feeds, y)
            flat[i] = old - eps
            lm = trainer.compute_gradients(feeds, y)
            flat[i] = old
            numeric.reshape(-1)[i] = (lp - lm) / (2 * eps)
        np.testing.assert_allclose(analytic, numeric, rtol=tol, atol=tol, err_msg=name)


class _MultiInputTrainer(minidl.Trainer):
    """Feeds several network inputs (the Trainer API takes one input array)."""

    def compute_gradients(self, feeds, y):
        c = self.engine.compiled([f.shape for f in feeds], tuple(y.shape), True)
        loss, _ = c.executor.run([*feeds, y], training=True, seed=self.seed)
        return loss


def test_whole_network_gradient_check_with_fanout_add_concat_and_two_inputs():
    net = _residual_concat_net()
    tr = _MultiInputTrainer(net, SGD(net.parameters(), lr=0.0), device_memory="4MiB")
    rng = np.random.default_rng(1)
    feeds = [rng.standard_normal((4, 6)), rng.standard_normal((4, 3))]
    y = rng.integers(0, 3, 4)
    _finite_difference_check(tr, feeds, y)


def test_parameters_use_pytorch_names_and_layouts():
    net = minidl.Sequential([L.Flatten(), L.Linear(64, 16), L.ReLU(), L.Linear(16, 10)],
                            input_shape=(1, 8, 8))
    names = [n for n, _ in net.named_parameters()]
    assert names == ["1.weight", "1.bias", "3.weight", "3.bias"]
    assert dict(net.named_parameters())["1.weight"].shape == (16, 64)
    sd = net.state_dict()
    sd["1.bias"] = np.full(16, 0.5, np.float32)
    net.load_state_dict(sd)
    assert np.all(dict(net.named_parameters())["1.bias"].data == 0.5)
    with pytest.raises(ValueError, match="1.weight"):
        net.load_state_dict({**sd, "1.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(KeyError, match="missing"):
        net.load_state_dict({"1.weight": sd["1.weight"]})


def test_shape_mismatch_names_layer_and_shapes():
    net = minidl.Sequential([L.Flatten(), L.Linear(10, 5)])
    with pytest.raises(minidl.ShapeError, match=r"1.*10.*64|1.*64.*10"):
        net.infer([(2, 1, 8, 8)])
    net2 = minidl.Sequential([L.Flatten(), L.Linear(64, 5)], input_shape=(1, 8, 8))
    with pytest.raises(minidl.ShapeError, match=r"\(1, 8, 8\).*\(1, 9, 9\)"):
        net2.infer([(2, 1, 9, 9)])


def _mlp(seed=0):
    return minidl.Sequential(
        [L.Flatten(), L.Linear(64, 32), L.ReLU(), L.Dropout(0.2), L.Linear(32, 10)],
        input_shape=(1, 8, 8), seed=seed)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, n)


def test_same_seed_same_losses_and_loss_decreases():
    x, y = _data()
    runs = []
    for _ in range(2):
        net = _mlp()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9),
                            device_memory="8MiB")
        runs.append([tr.step(x, y) for _ in range(15)])
    assert runs[0] == runs[1]
    assert runs[0][-1] < 0.5 * runs[0][0]


def test_save_load_continue_is_bit_identical(tmp_path):
    x, y = _data()
    net = _mlp()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), device_memory="8MiB")
    straight = [tr.step(x, y) for _ in range(6)]

    net = _mlp()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), device_memory="8MiB")
    first = [tr.step(x, y) for _ in range(3)]
    path = tmp_path / "ckpt.npz"
    tr.save(path)
    net2 = _mlp(seed=123)  # different init: everything must come from the checkpoint
    tr2 = minidl.Trainer(net2, SGD(net2.parameters(), lr=0.05, momentum=0.9),
                         device_memory="8MiB")
    tr2.load(path)
    resumed = first + [tr2.step(x, y) for _ in range(3)]
    assert resumed == straight


def test_dry_run_peak_equals_real_run_peak():
    from minidl.zoo.models import lenet5

    x, y = _data(32)
    for make, shape in [(_mlp, (1, 8, 8)), (lambda: lenet5((1, 8, 8)), (1, 8, 8))]:
        rep = minidl.dry_run(make(), 32, "none", input_shape=shape)
        net = make()
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                            device_memory="16MiB")
        tr.step(x, y)
        assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"]
        assert tr.memory_report()["peak_reserved_bytes"] == rep["peak_reserved_bytes"]
        assert rep["lower_bound_bytes"] <= rep["peak_allocated_bytes"]


def test_bad_inputs_raise_clear_errors():
    net = _mlp()
    tr = minidl.Trainer(net, device_memory="8MiB")
    x, y = _data(8)
    with pytest.raises(minidl.ShapeError, match="per-sample shape"):
        tr.step(np.zeros((8, 1, 9, 9), np.float32), y)
    with pytest.raises(TypeError, match="float"):
        tr.step(x.astype(bool), y)
    bad = x.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        tr.step(bad, y)
    with pytest.raises(ValueError, match="labels"):
        tr.step(x, y[:4])
    with pytest.raises(IndexError):
        tr.step(x, np.full(8, 11))


def test_non_finite_loss_names_the_layer():
    net = _mlp()
    w = dict(net.named_parameters())["1.weight"]
    w.data[...] = 3e38
    tr = minidl.Trainer(net, device_memory="8MiB")
    x, y = _data(8)
    with pytest.raises(minidl.NonFiniteError, match=r"layer 1 \(Linear"):
        tr.step(np.abs(x) + 1, y)


def test_device_memory_too_small_raises_and_leaves_pool_clean():
    net = _mlp()
    tr = minidl.Trainer(net, device_memory="40KiB")
    before = tr.pool.stats()["allocated_bytes.current"]
    x, y = _data(64)
    with pytest.raises(minidl.DeviceOutOfMemory) as err:
        tr.step(x, y)
    assert "cannot allocate" in str(err.value) and "capacity" in str(err.value)
    assert tr.pool.stats()["allocated_bytes.current"] == before
    assert tr.pool.stats()["num_ooms"] == 1
    tr.pool.check_invariants()


def test_unknown_memory_flag_lists_valid_flags():
    with pytest.raises(ValueError, match="valid: .*none"):
        minidl.MemoryConfig.parse("reuse,bogus")


def test_eval_mode_is_deterministic_and_does_not_touch_running_stats():
    net = minidl.Sequential([L.Flatten(), L.Linear(64, 16), L.BatchNorm1d(16), L.ReLU(),
                             L.Dropout(0.5), L.Linear(16, 10)], input_shape=(1, 8, 8))
    tr = minidl.Trainer(net, device_memory="8MiB")
    x, y = _data(32)
    tr.step(x, y)
    rm = np.array(dict(net.named_parameters(True))["2.running_mean"].data)
    a = tr.predict(x)
    b = tr.predict(x)
    assert np.array_equal(a, b)
    np.testing.assert_array_equal(dict(net.named_parameters(True))["2.running_mean"].data, rm)
    loss, acc = tr.evaluate(x, y)
    assert np.isfinite(loss) and 0 <= acc <= 1


def test_close_moves_parameters_back_to_host():
    net = _mlp()
    tr = minidl.Trainer(net, device_memory="8MiB")
    x, y = _data(8)
    tr.step(x, y)
    w = np.array(net.parameters()[0].data)
    tr.close()
    assert tr.pool.stats()["allocated_bytes.current"] == 0
    np.testing.assert_array_equal(net.parameters()[0].data, w)


def test_evaluate_halves_batches_that_do_not_fit():
    from minidl.zoo.models import smallcnn

    net = smallcnn((1, 16, 16), 10, width=8)
    small = minidl.dry_run(smallcnn((1, 16, 16), 10, width=8), 8, "reuse",
                           input_shape=(1, 16, 16), training=False)["peak_reserved_bytes"]
    tr = minidl.Trainer(net, memory="reuse", device_memory=small + 65536)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 64)
    loss, acc = tr.evaluate(x, y, batch_size=64)
    ref = minidl.Trainer(smallcnn((1, 16, 16), 10, width=8), device_memory="64MiB")
    loss2, acc2 = ref.evaluate(x, y, batch_size=8)
    assert acc == acc2 and abs(loss - loss2) < 1e-5


def test_a_second_trainer_takes_the_network_over_and_the_first_refuses_to_run():
    """Parameters live in one trainer's pool at a time: a second trainer binds them (with
    their values), the first then says so instead of training the other's memory."""
    import pickle

    from minidl.net.optim import SGD
    from minidl.zoo.models import smallcnn

    net = smallcnn((1, 8, 8), 10, width=2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 10, 2)
    first = minidl.Trainer(net, SGD(net.parameters(), lr=0.1), device_memory="16MiB")
    first.step(x, y)
    trained = {k: np.array(v) for k, v in net.state_dict().items()}
    second = minidl.Trainer(net, SGD(net.parameters(), lr=0.1), device_memory="16MiB")
    for k, v in net.state_dict().items():  # the values moved with the binding
        assert np.array_equal(v, trained[k]), k
    with pytest.raises(RuntimeError, match="bound by another Trainer"):
        first.step(x, y)
    second.step(x, y)
    first.close()  # releasing the first leaves the second's parameters alone
    assert all(p.bound_to is second.engine for p in net.parameters())
    second.step(x, y)
    copy = pickle.loads(pickle.dumps(net))  # a bound network pickles as host arrays
    assert all(p.bound_to is None for p in copy.parameters())
    for (k, a), b in zip(net.state_dict().items(), copy.state_dict().values()):
        assert np.array_equal(a, b), k


def test_lowering_takes_one_sharding_value_as_it_took_the_two_lists():
    """A ``Sharding`` (what ZeRO 2/3 hand to lowering) lowers as ``grad_shards`` /
    ``param_shards`` did: shards persistent, full gradients and gathered parameters not."""
    from minidl.compile.lowering import Sharding, lower
    from minidl.layers import SoftmaxCrossEntropy
    from minidl.zoo.models import get_model

    net = get_model("lenet5", (1, 28, 28), 10)
    net.infer([(2, 1, 28, 28)])
    shard = [("w.shard", (8,), "float32")]
    a = lower(net, [(2, 1, 28, 28)], loss=SoftmaxCrossEntropy(), label_shape=(2,),
              sharding=Sharding(tuple(shard), tuple(shard)))
    b = lower(net, [(2, 1, 28, 28)], loss=SoftmaxCrossEntropy(), label_shape=(2,),
              grad_shards=shard, param_shards=shard)
    assert a.program.tensors == b.program.tensors and a.program.steps == b.program.steps
    roles = {t.role for t in a.program.tensors if t.persistent}
    assert {"grad_shard", "param_shard"} <= roles and "param_grad" not in roles


def test_step_hooks_are_called_around_the_steps():
    """The executor calls a StepHooks' before_step before every step and after_backward_step
    after every backward step (minidl/compile/hooks.py)."""
    from types import SimpleNamespace

    from minidl.train.trainer import Trainer
    from minidl.zoo.models import get_model

    net = get_model("lenet5", (1, 8, 8), 10)
    trainer = Trainer(net, memory="reuse,inplace", device_memory="8MiB")
    calls = []
    trainer.parallel = SimpleNamespace(
        before_step=lambda ex, i: calls.append(("before", i)),
        after_backward_step=lambda ex, i: calls.append(("after", i)), batch_sync=None)
    x = np.random.default_rng(0).standard_normal((4, 1, 8, 8)).astype(np.float32)
    trainer._local_gradients(x, np.arange(4))
    (compiled,) = trainer.engine._cache.values()
    steps = compiled.plan.program.steps
    befores = [i for k, i in calls if k == "before"]
    afters = [i for k, i in calls if k == "after"]
    assert befores == list(range(len(steps)))
    assert afters == [i for i, st in enumerate(steps) if st.phase == "backward"]
