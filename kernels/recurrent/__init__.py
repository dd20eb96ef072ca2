"""LSTM and GRU cell kernels, host and device."""
