"""minidl.layers: pure math with declared needs (one layer per file). Imports no framework code."""

from .activation.gelu import GELU
from .activation.leaky_relu import LeakyReLU
from .activation.relu import ReLU
from .activation.sigmoid import Sigmoid
from .activation.tanh import Tanh
from .add import Add
from .base import Context, Layer, ParamSpec, ShapeError, Symbol
from .checkpoint import Checkpoint
from .concat import Concat
from .convolution.conv2d import Conv2d
from .dropout import Dropout
from .flatten import Flatten
from .linear import Linear
from .loss.mse_loss import MSELoss
from .loss.softmax_cross_entropy import SoftmaxCrossEntropy
from .normalization.batchnorm import BatchNorm1d, BatchNorm2d
from .normalization.layernorm import LayerNorm
from .pooling.global_avg_pool import GlobalAvgPool2d
from .pooling.pool import AvgPool2d, MaxPool2d
from .recurrent.fused import GRU, LSTM
from .recurrent.gru import GRUCell
from .recurrent.lstm import LSTMCell
from .recurrent.rnn_projection import RNNInputProjection
from .recurrent.time_stack import TimeStack
from .recurrent.zero_state import ZeroState
from .transformer.attention import MultiHeadAttention
from .transformer.embedding import Embedding
from .transformer.positional_embedding import PositionalEmbedding

__all__ = [
    "GRU", "GRUCell", "LSTM", "LSTMCell", "RNNInputProjection",
    "Add", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Concat", "Context", "Conv2d", "Dropout",
    "Embedding", "Flatten", "GlobalAvgPool2d", "Layer", "LeakyReLU", "Linear", "MaxPool2d",
    "MSELoss", "ParamSpec", "ReLU", "ShapeError", "Sigmoid", "SoftmaxCrossEntropy", "Symbol",
    "Tanh", "TimeStack", "ZeroState",
    "GELU", "LayerNorm", "MultiHeadAttention", "PositionalEmbedding", "Checkpoint",
]
