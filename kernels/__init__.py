"""minidl.kernels: pure array functions — a NumPy reference, a Numba CPU and a Numba CUDA
version of each op, chosen by array type. No framework imports.

Sub-packages by op family (convolution, pooling, normalization, transformer, recurrent,
codecs, compression, pointwise); the infrastructure every family uses (array namespaces, CUDA
launching and its emulation, BLAS and small GEMMs, the thread policy, workspace layouts, Numba
compile notices) sits at the top.
"""
