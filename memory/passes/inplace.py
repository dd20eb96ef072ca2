"""``inplace``: outputs written over inputs where the op allows it (ReLU, LeakyReLU, Add,
Dropout, Sigmoid/Tanh), only when liveness proves the input dead afterwards (Chen et al.,
MXNet)."""

from __future__ import annotations

from ..ir.liveness import lifetimes
from ..ir.program import Program
from .sharing import share_blocks


def inplace_aliases(program: Program, aliases: dict[int, int] | None = None) -> dict[int, int]:
    """Forward outputs written over inputs that no later step reads."""
    return share_blocks(program, lifetimes(program), {"forward"}, aliases)
