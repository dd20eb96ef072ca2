"""Defining networks: the graph API (Input, Network, Sequential), named blocks, parameters and
their optimizers, labels.
"""
