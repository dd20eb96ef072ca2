"""Pooling layers: MaxPool2d, AvgPool2d, GlobalAvgPool2d."""
