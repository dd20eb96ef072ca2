"""``reuse``: Layrub's layer-wise memory reuse, by liveness.

Every feature map, stash and gradient map is freed right after its last use, so memory is
reused across layers through the pool: feature maps backward does not need die during the
forward pass, gradient maps as soon as they are consumed. Within a layer (Layrub's intra-layer
reuse), a backward that allows it writes its input gradient over its output gradient.
Parameter gradients are persistent: allocated once and kept.
"""

from __future__ import annotations

from ..ir.liveness import lifetimes
from ..ir.program import Program
from .sharing import share_blocks


def intra_layer_aliases(program: Program, aliases: dict[int, int] | None = None) -> dict[int, int]:
    """Input gradients written over dead output gradients (backward in-place)."""
    return share_blocks(program, lifetimes(program), {"backward"}, aliases)
