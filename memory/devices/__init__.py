"""Devices: the Device protocol and one reader of its traits, the CPU arena, the meta device
of dry runs, copy engines, and the CUDA device (cuda_device, cuda_streams, cuda_interop: the
only modules that know CuPy).
"""
