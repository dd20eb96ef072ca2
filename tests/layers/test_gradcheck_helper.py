"""The gradcheck helper itself: it must catch the mistakes it exists to catch."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import check_gradients, check_inplace, make_inputs

from minidl.layers import Context, Layer


class _Square(Layer):
    """y = x**2; honest version retains the input."""

    kind = "act"
    retain_inputs = (0,)

    def forward(self, ctx, inputs, outputs, params, stash, workspace):
        np.multiply(inputs[0], inputs[0], out=outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        if grad_inputs[0] is not None:
            np.multiply(grad_outputs[0], 2 * inputs[0], out=grad_inputs[0])


class _Hidden(_Square):
    """Declares nothing retained but keeps a reference to the input."""

    retain_inputs = ()

    def forward(self, ctx, inputs, outputs, params, stash, workspace):
        self._x = inputs[0]
        super().forward(ctx, inputs, outputs, params, stash, workspace)

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        np.multiply(grad_outputs[0], 2 * self._x, out=grad_inputs[0])


class _WrongGrad(_Square):
    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        np.multiply(grad_outputs[0], 2.001 * inputs[0], out=grad_inputs[0])


class _Accumulates(_Square):
    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        grad_inputs[0] += grad_outputs[0] * 2 * inputs[0]


class _PartialOutput(_Square):
    def forward(self, ctx, inputs, outputs, params, stash, workspace):
        np.multiply(inputs[0][:-1], inputs[0][:-1], out=outputs[0][:-1])


class _BadInplace(_Square):
    """Claims in-place backward but reads dy after writing dx."""

    retain_outputs = (0,)
    retain_inputs = ()
    inplace_backward = True

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace):
        dx, dy = grad_inputs[0], grad_outputs[0]
        dx[...] = 0
        dx += dy * 2 * np.sqrt(outputs[0]) * np.sign(dy + 10)


def _x():
    return make_inputs(_Square(), [(3, 4)], np.random.default_rng(1))


def test_honest_layer_passes():
    check_gradients(_Square(), _x())


@pytest.mark.parametrize("layer", [_Hidden(), _WrongGrad(), _Accumulates(), _PartialOutput()])
def test_mistakes_are_caught(layer):
    with pytest.raises(AssertionError):
        check_gradients(layer, _x())


def test_unsafe_inplace_is_caught():
    x = [np.abs(_x()[0]) + 0.5]
    with pytest.raises(AssertionError):
        check_inplace(_BadInplace(), x, ctx=Context())
