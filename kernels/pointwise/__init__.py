"""Elementwise work: sums, activations, dropout masks, the softmax cross-entropy loss on device,
fused optimizer updates.
"""
