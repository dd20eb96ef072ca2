"""The fit loop: epochs of batches from a source (image epochs, text windows), validation,
callbacks, the History of a fit, and training a text model."""
