"""Attention in its two memory forms and its row kernels, the device kernels of attention, GELU,
embedding rows.
"""
