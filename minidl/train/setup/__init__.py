"""What a trainer is built from: its options, the device and its pool, the optimizer, the
engine and data parallelism."""
