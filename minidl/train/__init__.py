"""Training: the Trainer, the fit loop, callbacks."""
