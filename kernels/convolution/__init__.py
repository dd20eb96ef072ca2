"""2-D convolution: the NumPy reference, im2col + GEMM and Winograd CPU kernels, the device path,
the geometry and algorithm choice, the call record.
"""
