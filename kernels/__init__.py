"""minidl.kernels: pure array functions (NumPy reference, Numba CPU, Numba CUDA). No framework imports."""
