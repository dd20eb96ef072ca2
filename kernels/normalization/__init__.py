"""Batch and layer normalisation kernels, host and device."""
