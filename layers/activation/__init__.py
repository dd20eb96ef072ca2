"""Activation layers: ReLU, LeakyReLU, Sigmoid, Tanh, GELU."""
