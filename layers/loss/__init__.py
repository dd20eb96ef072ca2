"""Loss layers: MSELoss, SoftmaxCrossEntropy."""
