"""BatchNorm1d/2d: gradients (train and eval), PyTorch's running-statistics formulas,
eval mode, recomputation leaves buffers alone, shape errors."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import LAYER_SETTINGS, check_layer, forward_backward, make_inputs, make_params, seeds
from hypothesis import given
from hypothesis import strategies as st

from minidl.layers import Context, ShapeError
from minidl.layers.normalization.batchnorm import BatchNorm1d, BatchNorm2d


def _bn_shape(draw_rank, n, c, spatial):
    return (n, c, *spatial[: draw_rank - 2])


@LAYER_SETTINGS
@given(rank=st.sampled_from([2, 3, 4]), n=st.integers(1, 4), c=st.integers(1, 4),
       spatial=st.lists(st.integers(1, 4), min_size=2, max_size=2), affine=st.booleans(),
       track=st.booleans(), training=st.booleans(), seed=seeds)
def test_batchnorm_gradients(rank, n, c, spatial, affine, track, training, seed):
    shape = _bn_shape(rank, n, c, spatial)
    if training and n * int(np.prod(shape[2:])) < 2:
        shape = (2, *shape[1:])
    layer = (BatchNorm2d if rank == 4 else BatchNorm1d)(c, affine=affine,
                                                       track_running_stats=track)
    rng = np.random.default_rng(seed)
    xs = make_inputs(layer, [shape], rng)
    xs[0] = xs[0] * 2 + rng.standard_normal((1, c) + (1,) * (rank - 2))
    # with batch statistics, float32 error grows like 1/std: two nearly equal samples of a
    # channel (std 0.03 in one found case) put float32 3e-3 away from float64, honestly;
    # the float64 gradient check still runs there
    axes = (0,) + tuple(range(2, rank))
    ill = (training or not track) and float(xs[0].var(axis=axes).min()) < 0.05
    check_layer(layer, xs, rng=rng, ctx=Context(training=training), rtol=1e-4, atol=1e-6,
                float32=not ill)


def _by_hand(x, params, momentum, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes)
    var = x.var(axis=axes)
    m = x.size // x.shape[1]
    rm = (1 - momentum) * params["running_mean"] + momentum * mean
    rv = (1 - momentum) * params["running_var"] + momentum * var * m / (m - 1)
    bshape = (1, -1) + (1,) * (x.ndim - 2)
    y = (x - mean.reshape(bshape)) / np.sqrt(var.reshape(bshape) + eps)
    y = y * params["weight"].reshape(bshape) + params["bias"].reshape(bshape)
    return y, rm, rv


@pytest.mark.parametrize("cls,shape", [(BatchNorm1d, (8, 3)), (BatchNorm1d, (4, 3, 5)),
                                       (BatchNorm2d, (4, 3, 5, 6))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_running_statistics_as_pytorch(cls, shape, dtype):
    rng = np.random.default_rng(1)
    layer = cls(3, momentum=0.3, eps=1e-3)
    params = {k: v.astype(dtype) for k, v in make_params(layer, rng).items()}
    x = (rng.standard_normal(shape) * 3 + 5).astype(dtype)
    res = forward_backward(layer, Context(training=True), [x], params)
    y, rm, rv = _by_hand(x.astype(np.float64), {k: v.astype(np.float64)
                                                for k, v in params.items()}, 0.3, 1e-3)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(res.outputs[0], y, rtol=tol, atol=tol)
    np.testing.assert_allclose(res.params_after["running_mean"], rm, rtol=tol)
    np.testing.assert_allclose(res.params_after["running_var"], rv, rtol=tol)
    assert res.params_after["running_var"].dtype == dtype
    assert res.stash["mean"].dtype == dtype and res.stash["invstd"].dtype == dtype


def test_eval_uses_running_statistics():
    rng = np.random.default_rng(2)
    layer = BatchNorm2d(3)
    params = make_params(layer, rng)
    x = rng.standard_normal((2, 3, 4, 4))
    res = forward_backward(layer, Context(training=False), [x], params)
    b = (1, -1, 1, 1)
    want = (x - params["running_mean"].reshape(b)) / np.sqrt(
        params["running_var"].reshape(b) + 1e-5
    ) * params["weight"].reshape(b) + params["bias"].reshape(b)
    np.testing.assert_allclose(res.outputs[0], want, rtol=1e-12)
    for k in ("running_mean", "running_var"):
        np.testing.assert_array_equal(res.params_after[k], params[k])


def test_recomputing_leaves_buffers_untouched():
    rng = np.random.default_rng(3)
    layer = BatchNorm1d(4)
    params = make_params(layer, rng)
    x = rng.standard_normal((6, 4))
    first = forward_backward(layer, Context(training=True), [x], params)
    again = forward_backward(layer, Context(training=True, recomputing=True), [x], params)
    np.testing.assert_array_equal(again.outputs[0], first.outputs[0])
    for k in ("running_mean", "running_var"):
        np.testing.assert_array_equal(again.params_after[k], params[k])
        assert not np.array_equal(first.params_after[k], params[k])


def test_single_value_per_channel_in_training():
    layer = BatchNorm1d(3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        forward_backward(layer, Context(training=True), [np.ones((1, 3))],
                         make_params(layer, np.random.default_rng(0)))


def test_declarations():
    layer = BatchNorm2d(64)
    specs = layer.param_specs()
    assert list(specs) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    tracked = specs["num_batches_tracked"]
    assert tracked.shape == () and tracked.dtype == "int64" and not tracked.trainable
    assert specs["weight"].init == "ones" and specs["bias"].init == "zeros"
    assert specs["running_mean"].init == "zeros" and not specs["running_mean"].trainable
    assert specs["running_var"].init == "ones" and not specs["running_var"].trainable
    assert list(BatchNorm2d(3, affine=False, track_running_stats=False).param_specs()) == []
    assert layer.stash_specs([(2, 64, 5, 5)], np.dtype(np.float32)) == {
        "mean": ((64,), np.float32), "invstd": ((64,), np.float32)}
    assert layer.retain_inputs == (0,) and not layer.inplace_forward
    assert layer.describe() == "BatchNorm2d(64)"
    assert BatchNorm1d(8, eps=1e-3).describe() == "BatchNorm1d(8, eps=0.001)"


@pytest.mark.parametrize("layer,shape", [(BatchNorm2d(3), (2, 3, 4)),
                                         (BatchNorm2d(3), (2, 4, 4, 4)),
                                         (BatchNorm1d(3), (2, 3, 4, 4)),
                                         (BatchNorm1d(3), (2, 5))])
def test_shape_errors(layer, shape):
    with pytest.raises(ShapeError, match=str(shape).replace("(", r"\(").replace(")", r"\)")):
        layer.output_shapes([shape])


@pytest.mark.parametrize("momentum", [-0.1, 1.5])
def test_momentum_outside_0_1_refused(momentum):
    with pytest.raises(ValueError, match="momentum"):
        BatchNorm2d(3, momentum=momentum)


def test_num_batches_tracked_counts_training_forwards_and_momentum_none_averages():
    """PyTorch's counter: +1 per training forward (not in eval, not when recomputing); with
    momentum=None the running mean is the plain average of the batch means so far."""
    layer = BatchNorm1d(2, momentum=None)
    assert layer.describe() == "BatchNorm1d(2, momentum=None)"
    rng = np.random.default_rng(0)
    params = make_params(layer, rng, randomize=False)
    batch_means = []
    for _ in range(3):
        x = rng.standard_normal((5, 2)) * 3 + 1
        batch_means.append(x.mean(axis=0))
        params = forward_backward(layer, Context(training=True), [x], params).params_after
    assert params["num_batches_tracked"].dtype == np.int64
    assert int(params["num_batches_tracked"]) == 3
    np.testing.assert_allclose(params["running_mean"], np.mean(batch_means, axis=0), rtol=1e-12)
    for ctx in (Context(training=False), Context(training=True, recomputing=True)):
        after = forward_backward(layer, ctx, [rng.standard_normal((5, 2))], params).params_after
        assert int(after["num_batches_tracked"]) == 3
