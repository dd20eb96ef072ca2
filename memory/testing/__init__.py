"""Test doubles: the strict CUDA device (CuPy's rules checked on the CPU) and its stream model.
"""
