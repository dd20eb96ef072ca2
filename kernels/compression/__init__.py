"""Deep Compression's kernels: k-means weight sharing, relative CSR, Huffman coding, the compressed
weight record.
"""
