"""Convolution layers: Conv2d (and the workspace caps its algorithms take)."""
