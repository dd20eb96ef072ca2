"""Magnitude pruning with retraining (Han et al. 2015, the first stage of Deep Compression).

Each layer's smallest weights (by magnitude) are removed: a mask keeps the others. Pruning is
iterative: the pruned fraction rises over rounds (:func:`schedule`), with retraining between
rounds so the remaining weights take over from the removed ones.

:class:`MaskedOptimizer` keeps pruned weights at zero through any optimizer: it wraps the
trainer's optimizer, masks the gradients before the update (so momentum and Adam's moments of
pruned weights stay zero) and the weights after it (so weight decay cannot move them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from ..kernels.array_api import namespace
from ..net.optim import Optimizer, OptimizerWrapper
from ..net.parameter import Parameter


def magnitude_mask(weights: Any, fraction: float) -> np.ndarray:
    """A boolean mask keeping all but the ``round(fraction * size)`` smallest-magnitude
    weights (the earlier one of equal magnitudes is pruned first). Weights that are already
    zero count among the smallest, so masks only shrink from round to round."""
    w = np.asarray(weights).reshape(-1)
    n_pruned = int(round(float(fraction) * w.size))
    mask = np.ones(w.size, dtype=bool)
    if n_pruned > 0:
        mask[np.argsort(np.abs(w), kind="stable")[:n_pruned]] = False
    return mask.reshape(np.shape(weights))


def schedule(target: float, rounds: int) -> list[float]:
    """Pruned fractions of ``rounds`` rounds reaching ``target``: the kept fraction shrinks by
    the same factor each round (``1 - (1 - target) ** (i / rounds)``), so early rounds remove
    a larger share of the many small weights and later ones fewer."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [1.0 - (1.0 - target) ** (i / rounds) for i in range(1, rounds + 1)]


class MaskedOptimizer(OptimizerWrapper):
    """``inner``'s updates with the weights named in ``masks`` (parameter name -> boolean
    array of its shape; ``False`` = pruned) held at zero."""

    def __init__(self, inner: Optimizer, masks: dict[str, np.ndarray]) -> None:
        super().__init__(inner)
        names = {p.name for p in inner.params}
        unknown = sorted(set(masks) - names)
        if unknown:
            raise ValueError(f"masks for parameters the optimizer does not update: "
                             f"{', '.join(unknown)}")
        self.masks = {k: np.asarray(m, dtype=bool) for k, m in masks.items()}
        self._on_device: dict[tuple[str, type], Any] = {}

    def _mask(self, p: Parameter) -> Any:
        """``p``'s mask as an array of ``p``'s module and dtype (made once per array type)."""
        key = (p.name, type(p.data))
        if key not in self._on_device:
            m = self.masks[p.name]
            if m.shape != p.shape:
                raise ValueError(f"mask of {p.name} has shape {m.shape}, the parameter {p.shape}")
            self._on_device[key] = namespace(p.data).asarray(m.astype(p.dtype))
        return self._on_device[key]

    def apply(self, params: Iterable[Parameter] | None = None) -> None:
        """Zero the pruned weights (and their gradients, where there are some)."""
        for p in params if params is not None else self.inner.params:
            if p.name in self.masks:
                m = self._mask(p)
                np.multiply(p.data, m, out=p.data)
                if p.grad is not None:
                    np.multiply(p.grad, m, out=p.grad)

    def step(self) -> None:
        for p in self.inner.params:
            if p.name in self.masks and p.grad is not None:
                np.multiply(p.grad, self._mask(p), out=p.grad)
        self.inner.step()
        for p in self.inner.params:
            if p.name in self.masks:
                np.multiply(p.data, self._mask(p), out=p.data)
