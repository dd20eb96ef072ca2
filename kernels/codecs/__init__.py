"""Gist's and cDMA's encodings of stashed feature maps: sign bits, reduced precision, sparse
formats (host and device).
"""
