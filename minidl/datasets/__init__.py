"""Data: the datasets, their streamed loaders, text corpora."""
