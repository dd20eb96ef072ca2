"""Where a fit stands (FitState) and the checkpoints that save and restore it."""
