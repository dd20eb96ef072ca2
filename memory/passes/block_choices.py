"""Per-block memory choices: the user forces ``recompute``, ``swap`` or ``keep`` for the
feature maps of some ops (``torch.utils.checkpoint``, ``jax.checkpoint``), and every planner
treats the choice as a constraint.

The choice reaches memory as plain data: :attr:`~.program.Step.op.forced` on the op's steps,
set at lowering from the network's block marks. This module reads it back as sets a planner
uses:

* ``recompute`` — the op's forward step is dropped: its outputs are never checkpoints and are
  recomputed in backward (by every ``recompute=`` policy, by ``auto`` as a fixed drop, and
  without any ``recompute=`` flag too);
* ``swap`` — its outputs are offloaded after forward and prefetched for backward (with or
  without ``swap=``; ``auto`` fixes the swap);
* ``keep`` — neither: its outputs stay checkpoints under every recompute policy and are never
  swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.names import Category, Name, Phase, Role
from ..ir.program import Program


class BlockChoice(Name):
    """What a ``Checkpoint`` block forces on its feature maps (``Step.op.forced``)."""

    RECOMPUTE = "recompute"
    SWAP = "swap"
    KEEP = "keep"


#: The choices a block may force, as plain strings (for messages and the network's checks).
BLOCK_CHOICES = tuple(c.value for c in BlockChoice)


@dataclass(frozen=True)
class BlockChoices:
    """What the network's blocks force on a program: forward step indices to drop, and the
    feature maps (value tensor ids) to swap and to keep."""

    dropped: frozenset[int] = frozenset()
    swapped: frozenset[int] = frozenset()
    kept: frozenset[int] = frozenset()
    #: Feature maps the dropped steps write.
    recomputed: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.dropped or self.swapped or self.kept)

    @property
    def fixed(self) -> frozenset[int]:
        """Feature maps whose fate the user chose (a planner may not change it)."""
        return self.swapped | self.kept | self.recomputed

    def describe(self) -> str:
        """One line for a plan's notes."""
        return (f"blocks force: recompute {len(self.dropped)} layers, swap "
                f"{len(self.swapped)} feature maps, keep {len(self.kept)}")


def block_choices(program: Program) -> BlockChoices:
    """The choices the forward steps of ``program`` carry (:attr:`~.program.Step.op.forced`).
    The loss is never dropped; a choice other than :data:`BLOCK_CHOICES` raises
    ``ValueError``."""
    if not program.training:
        return BlockChoices()
    loss_step = next((st.index for st in program.steps
                      if st.phase == Phase.FORWARD and program.loss in st.access.writes), -1)
    dropped, swapped, kept, recomputed = set(), set(), set(), set()
    for st in program.steps:
        if st.phase != Phase.FORWARD or not st.op.forced or st.index == loss_step:
            continue
        if st.op.forced not in BLOCK_CHOICES:
            raise ValueError(f"layer {st.layer}: memory choice {st.op.forced!r} is not one of "
                             f"{', '.join(BLOCK_CHOICES)}")
        outs = {t for t in st.access.writes if program.tensors[t].role == Role.VALUE
                and program.tensors[t].category == Category.FEATURE_MAP}
        if not outs:
            continue
        if st.op.forced == BlockChoice.RECOMPUTE:
            dropped.add(st.index)
            recomputed |= outs
        elif st.op.forced == BlockChoice.SWAP:
            swapped |= outs
        else:
            kept |= outs
    return BlockChoices(frozenset(dropped), frozenset(swapped), frozenset(kept),
                        frozenset(recomputed))
