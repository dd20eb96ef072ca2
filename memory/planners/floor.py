"""The least peak any plan of a program can reach: a floor found in one pass over its steps.

Every plan, whatever it keeps, swaps, recomputes or encodes, runs each forward step once with
its inputs and outputs whole on the device, and each backward step with its output gradients,
the input gradients it writes (and the gradients those add into), and the values its layer
retains — unless the layer's backward can start from an encoded form of them, which can be
smaller. Per-op variants change only what the layer keeps for itself: a convolution's
workspace can be capped to (near) nothing, attention's blockwise form and a fused RNN's BPTT
schedule change the stash and the workspace. So the persistent state plus the largest of those
unavoidable sets is below the peak of every plan of the program at this batch: a budget under
it is refused at once, without planning (:func:`peak_floor`). It is no least peak reached —
plans may need more (liveness across steps) — only a bound no plan goes under.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.names import Phase
from ..ir.program import Program, Step

#: Per-op options that change a step's workspace or stash (they may take them to nothing).
VARIANT_OPTIONS = frozenset({"conv_ws", "attn", "bptt"})


@dataclass(frozen=True)
class PeakFloor:
    """A peak no plan of the program goes under: ``persistent`` bytes (parameters, gradients,
    optimizer state) plus ``step_bytes``, what step ``step`` (``layer``'s ``phase``) must
    hold whole."""

    persistent: int
    step_bytes: int
    step: int
    layer: str
    phase: str

    @property
    def bytes(self) -> int:
        return self.persistent + self.step_bytes

    def refusal(self, budget: int) -> str:
        """One sentence: why ``budget`` cannot be met, and what holds the floor."""
        what = (f"the persistent state alone ({self.persistent:,} B of parameters, gradients "
                f"and optimizer state) exceeds it" if self.persistent >= budget else
                f"{self.persistent:,} B of parameters, gradients and optimizer state plus "
                f"{self.step_bytes:,} B that {self.layer}'s {self.phase} holds whole "
                f"(its inputs, outputs and gradients)")
        return (f"no plan fits the budget of {budget:,} B: every plan of this program needs at "
                f"least {self.bytes:,} B ({self.bytes / 2**20:.1f} MiB): {what}")


def unavoidable_bytes(program: Program, step: Step) -> int:
    """Aligned bytes of what ``step`` needs whole on the device in every plan (module
    docstring); a tensor the op may write over an operand of its size is counted once."""
    ids: set[int] = set()
    tensors = program.tensors
    if step.phase in (Phase.FORWARD, Phase.RECOMPUTE):
        ids.update(step.forward.inputs)
        ids.update(step.forward.outputs)
    elif step.phase == Phase.BACKWARD:
        ids.update(step.backward.grad_outputs)
        for gi in step.backward.grad_inputs:
            if gi is not None:
                ids.add(gi.written)
                if gi.add_into >= 0:
                    ids.add(gi.add_into)
        if not step.op.caps.backward_from:
            ids.update(step.forward.inputs[i] for i in step.backward.retained_inputs
                       if i < len(step.forward.inputs))
            ids.update(step.forward.outputs[i] for i in step.backward.retained_outputs
                       if i < len(step.forward.outputs))
    else:  # encode / decode steps: a plan need not have them
        return 0
    if step.access.workspace >= 0 and not (step.op.caps.options & VARIANT_OPTIONS):
        ids.add(step.access.workspace)
    ids = {i for i in ids if i >= 0 and not tensors[i].persistent}
    ids -= {w for w, r in step.access.shares if r in ids and w in ids
            and tensors[w].nbytes == tensors[r].nbytes}
    return sum(program.block_size(tensors[i].nbytes) for i in ids)


def peak_floor(program: Program) -> PeakFloor:
    """The floor of every plan's peak for ``program`` (module docstring)."""
    best, where = 0, -1
    for i, st in enumerate(program.steps):
        b = unavoidable_bytes(program, st)
        if b > best:
            best, where = b, i
    st = program.steps[where] if where >= 0 else None
    return PeakFloor(program.persistent_bytes(), best, where,
                     st.layer if st is not None else "(none)",
                     str(st.phase) if st is not None else "")
