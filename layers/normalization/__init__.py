"""Normalization layers: BatchNorm1d / BatchNorm2d, LayerNorm."""
