"""Mixed precision: what trains in it, and dynamic loss scaling for fp16."""
