"""Plan passes, one technique per module: reuse, in-place, sharing, recomputation, swapping,
compression, static offsets, BPTT, ZeRO, block choices.
"""
