"""One batch through the network: the training step (whole or in micro-batches) and its
checks, the inputs' checks, and eval-mode passes."""
