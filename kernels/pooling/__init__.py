"""Max and average pooling, host and device, and max-pool indices packed in bits."""
