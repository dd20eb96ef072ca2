"""ReLU: y = max(x, 0). Backward needs only the sign of its output."""

from __future__ import annotations

from ...kernels.codecs.bitpack import packed_nbytes, relu_backward_packed
from ...kernels.pointwise.relu import relu_backward, relu_forward
from ...kernels.vocabulary import StashEncoding
from ..base import Layer


class ReLU(Layer):
    kind = "relu"
    backward_from = (StashEncoding.SIGN,)
    sparse_output = True
    retain_outputs = (0,)
    inplace_forward = True
    inplace_backward = True

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        relu_forward(inputs[0], outputs[0])

    def backward(self, ctx, grad_outputs, grad_inputs, inputs, outputs, params, grad_params,
                 stash, workspace) -> None:
        if grad_inputs[0] is not None:
            # dy where y > 0, else +0.0 (as from Gist's packed sign mask); safe in place.
            relu_backward(grad_outputs[0], outputs[0], grad_inputs[0])

    def backward_from_encoded(self, encoding, encoded, grad_output, grad_input) -> None:
        """From the 1-bit sign mask of the output (Gist's binarize)."""
        if encoding != StashEncoding.SIGN:
            super().backward_from_encoded(encoding, encoded, grad_output, grad_input)
        relu_backward_packed(grad_output, encoded[:packed_nbytes(grad_output.size)],
                             out=grad_input)
