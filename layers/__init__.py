"""minidl.layers: pure math with declared needs (one layer per file). Imports no framework code."""

from .add import Add
from .attention import MultiHeadAttention
from .base import Context, Layer, ParamSpec, ShapeError, Symbol
from .batchnorm import BatchNorm1d, BatchNorm2d
from .checkpoint import Checkpoint
from .concat import Concat
from .conv2d import Conv2d
from .dropout import Dropout
from .embedding import Embedding
from .flatten import Flatten
from .gelu import GELU
from .global_avg_pool import GlobalAvgPool2d
from .gru import GRUCell
from .layernorm import LayerNorm
from .leaky_relu import LeakyReLU
from .linear import Linear
from .lstm import LSTMCell
from .mse_loss import MSELoss
from .pool import AvgPool2d, MaxPool2d
from .positional_embedding import PositionalEmbedding
from .recurrent import GRU, LSTM
from .relu import ReLU
from .rnn_projection import RNNInputProjection
from .sigmoid import Sigmoid
from .softmax_cross_entropy import SoftmaxCrossEntropy
from .tanh import Tanh
from .time_stack import TimeStack
from .zero_state import ZeroState

__all__ = [
    "GRU", "GRUCell", "LSTM", "LSTMCell", "RNNInputProjection",
    "Add", "AvgPool2d", "BatchNorm1d", "BatchNorm2d", "Concat", "Context", "Conv2d", "Dropout",
    "Embedding", "Flatten", "GlobalAvgPool2d", "Layer", "LeakyReLU", "Linear", "MaxPool2d",
    "MSELoss", "ParamSpec", "ReLU", "ShapeError", "Sigmoid", "SoftmaxCrossEntropy", "Symbol",
    "Tanh", "TimeStack", "ZeroState",
    "GELU", "LayerNorm", "MultiHeadAttention", "PositionalEmbedding", "Checkpoint",
]
