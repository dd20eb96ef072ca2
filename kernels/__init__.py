"""minidl.kernels: pure array functions — a NumPy reference, a Numba CPU and a Numba CUDA
version of each op, chosen by array type. No framework imports.

Sub-packages by op family (convolution, pooling, normalization, transformer, recurrent,
codecs, compression, pointwise); the infrastructure every family uses (array namespaces, CUDA
launching and its emulation, BLAS and small GEMMs, the thread policy, workspace layouts, Numba
compile notices) sits at the top.
"""

from .moved import install

#: Modules that lived flat in this package before its sub-packages (old name -> sub-package):
#: ``minidl.kernels.conv`` still imports, as the same module object as
#: ``minidl.kernels.convolution.conv``.
MOVED_MODULES = {
    "add": "pointwise",
    "attention": "transformer",
    "attention_rows": "transformer",
    "batchnorm": "normalization",
    "batchnorm_device": "normalization",
    "bitpack": "codecs",
    "conv": "convolution",
    "conv_call": "convolution",
    "conv_device": "convolution",
    "conv_geometry": "convolution",
    "conv_numba": "convolution",
    "conv_ref": "convolution",
    "dropout": "pointwise",
    "elementwise": "pointwise",
    "embedding": "transformer",
    "gelu": "transformer",
    "huffman": "compression",
    "kmeans": "compression",
    "layernorm": "normalization",
    "optim": "pointwise",
    "pool": "pooling",
    "pool_device": "pooling",
    "poolidx": "pooling",
    "precision": "codecs",
    "relative_csr": "compression",
    "relu": "pointwise",
    "rnn": "recurrent",
    "rnn_device": "recurrent",
    "softmax_xent": "pointwise",
    "sparse": "codecs",
    "sparse_device": "codecs",
    "sparse_format": "codecs",
    "transformer_device": "transformer",
    "weight_record": "compression",
    "winograd": "convolution",
    "winograd4": "convolution",
}
__getattr__ = install(__name__, MOVED_MODULES)
