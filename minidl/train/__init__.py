"""Training: the Trainer (:mod:`~minidl.train.trainer`) and the callbacks
(:mod:`~minidl.train.callbacks`), with their parts by job in the sub-packages: ``setup`` (options,
device, assembly), ``step`` (one batch), ``loop`` (the fit loop), ``state`` (fit state and
checkpoints), ``precision`` (mixed precision) and ``observation`` (peaks, reports)."""
