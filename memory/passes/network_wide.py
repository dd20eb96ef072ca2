"""The ``none`` baseline: network-wide allocation, as the papers measure against.

Every feature map, stash and gradient map is allocated when first written and lives until the
end of the iteration. Only a step's own scratch (its workspace, and a fan-out partial gradient
that is added into its target within the same step) is freed right after that step.

ZeRO's per-step copies of the model state (a stage-3 parameter gathered whole, a stage-2 full
gradient before its reduce-scatter) are not kept either: they exist so that no rank holds the
whole state for the iteration, so in every policy each is freed after its last use.
"""

from __future__ import annotations

from ..ir.program import Program

#: Roles freed right after the step that uses them, in every policy.
SCRATCH_ROLES = ("workspace", "grad_partial", "zeros")

#: Roles of model state; when such a tensor is not persistent it is a ZeRO per-step copy.
SHARDED_STATE_ROLES = ("param", "param_grad")


def network_wide_keep(program: Program) -> set[int]:
    """The tensors that live until the end of the iteration under network-wide allocation."""
    return {t.id for t in program.tensors
            if not t.persistent and t.role not in SCRATCH_ROLES
            and t.role not in SHARDED_STATE_ROLES}
