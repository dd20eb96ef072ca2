"""Dynamic loss scaling for ``fp16-mixed`` training, as ``torch.amp.GradScaler``: the loss
gradient is multiplied by ``scale`` so small float16 gradients do not flush to zero; before the
update the float32 gradients are divided by it; a step whose gradients hold inf or NaN is
skipped and the scale halved, and after ``growth_interval`` clean steps in a row it doubles."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DynamicLossScaler"]


@dataclass
class DynamicLossScaler:
    """The scale and its counters (all in :meth:`state_dict`, so a resumed run is exact)."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    #: Clean steps since the scale last changed.
    clean_steps: int = 0
    #: Steps skipped for inf / NaN gradients, since the start of the run.
    skipped: int = 0

    def unscale(self, parameters: Iterable[Any]) -> bool:
        """Divide every ``.grad`` by the scale (in place, float32); whether all are finite."""
        inverse = np.float32(1.0 / self.scale)
        finite = True
        for p in parameters:
            g = p.grad
            if g is None:
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                np.multiply(g, inverse, out=g)
                finite = finite and bool(np.isfinite(g).all())
        return finite

    def update(self, finite: bool) -> None:
        """After a step: back off and count a skip on non-finite gradients, else grow the
        scale after ``growth_interval`` clean steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])


def current_scale(scaler: DynamicLossScaler | None) -> float:
    """What the loss gradient is multiplied by: the scaler's scale (fp16-mixed), else 1."""
    return 1.0 if scaler is None else scaler.scale
