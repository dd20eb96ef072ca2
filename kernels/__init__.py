"""minidl.kernels: pure array functions — a NumPy reference, a Numba CPU and a Numba CUDA
version of each op, chosen by array type. No framework imports."""
