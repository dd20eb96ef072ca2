"""Devices: the CPU arena, the meta device of dry runs, the CUDA device (the one module that knows
CuPy).
"""
