"""Transformer layers: MultiHeadAttention, Embedding, PositionalEmbedding."""
