"""Attention's memory form as a per-op option of the plan (FlashAttention's trade: recompute
the probabilities in backward instead of keeping them).

A step whose capabilities include the ``"attn"`` option (self-attention) runs the form the
plan hands it: ``"keep"`` stores the probabilities (B, H, T, T) for backward, quadratic in the
sequence length T; ``"blockwise:<n>"`` runs over n x n tiles with a running max and sum,
stores only the row log-sum-exp (B, H, T) and recomputes each tile in backward: its stash is
linear in T, its workspaces hold a few tiles (larger tiles: fewer, larger products, more
workspace). Both forms are deterministic and agree to float rounding.

Memory sees the op through ``step.op.facts.attention`` (batch, seq, dim, heads, causal,
dropout) and sizes each form with the kernels' own layouts
(:mod:`minidl.kernels.transformer.attention`), the ones the layer declares, so the bytes here are
the
bytes a lowering with that option gives. Plain data, like :mod:`.bptt_options` and
:mod:`.workspace_options`: lowering sizes the step for the option, the executor hands it to
the layer in ``ctx.options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels.transformer import attention as ak
from ..ir.config import MemoryConfig
from ..ir.names import Phase
from ..ir.program import Program, Step
from ..ir.units import format_size

OPTION = "attn"
KEEP = ak.KEEP
#: Tile sizes of the blockwise candidates, largest (fastest, most workspace) first.
BLOCKS = (256, 128, 64, 32)
#: Notes this module writes start with this.
NOTE_PREFIX = "attention"


@dataclass(frozen=True)
class FormBytes:
    """Bytes of one attention op under one form: what forward keeps for backward, and the
    forward and backward workspaces."""

    stash: int
    forward_workspace: int
    backward_workspace: int


def attention_steps(program: Program) -> list[Step]:
    """The forward steps taking the option (one per attention op)."""
    return [st for st in program.steps
            if st.phase == Phase.FORWARD and OPTION in st.op.caps.options
            and st.op.facts.attention is not None]


def candidates(step: Step) -> list[str]:
    """Forms to consider for an attention op, keep first, then blockwise with tiles of
    :data:`BLOCKS` (no larger than the sequence; duplicates dropped)."""
    seq = step.op.facts.attention.seq
    out = [KEEP]
    for b in BLOCKS:
        form = f"{ak.BLOCKWISE}:{min(b, seq)}"
        if form not in out:
            out.append(form)
    return out


def form_bytes(program: Program, step: Step, form: str | None) -> FormBytes:
    """The stash and workspace bytes of ``step``'s op under ``form`` (``None``: keep), in
    the dtype the step computes in (its output's: half under mixed precision, whatever its
    input's), as the layer declares them: the row log-sum-exp, a statistic, at least float32."""
    a = step.op.facts.attention
    dt = np.dtype(program.tensors[step.forward.outputs[0]].dtype)
    block = ak.parse_form(form)
    geom = (a.batch, a.seq, a.dim, a.heads, block)
    stat = max(dt.itemsize, np.dtype(np.float32).itemsize)
    stash = sum(int(np.prod(s)) * (stat if k == "lse" else dt.itemsize)
                for k, s in ak.stash_shapes(*geom).items())
    drop = a.dropout
    fwd = ak.forward_layout(*geom, drop).nbytes(dt)
    bwd = ak.backward_layout(*geom, drop).nbytes(dt) if program.training else 0
    return FormBytes(stash, fwd, bwd)


def policies(program: Program, config: MemoryConfig) -> list[str | None]:
    """The forms to plan ``program`` with, in order of preference: ``[None]`` (each op's
    default, keep) unless ``auto`` with a budget, which tries keep, then blockwise with
    tiles from the largest down (:func:`candidates` of the longest sequence)."""
    steps = attention_steps(program)
    if not steps or not program.training:
        return [None]
    if config.auto and config.budget is not None:
        longest = max(steps, key=lambda st: st.op.facts.attention.seq)
        return list(candidates(longest))
    return [None]


def options_for(program: Program, form: str | None) -> dict[int, dict[str, Any]]:
    """Per node, the option of every attention op under ``form`` (empty for ``None``)."""
    if form is None:
        return {}
    ak.parse_form(form)  # refuse a bad form here, naming it
    return {st.node: {OPTION: form} for st in attention_steps(program)}


def describe(program: Program, form: str | None, tried: int) -> str:
    """A note saying which form the attention ops got and what their stash is under it."""
    steps = attention_steps(program)
    kept = sum(form_bytes(program, st, form).stash for st in steps)
    keep = sum(form_bytes(program, st, None).stash for st in steps)
    return (f"{NOTE_PREFIX}: {len(steps)} attention op(s) in form {form or KEEP} "
            f"({tried} candidate(s) tried, keep first): their stashes for backward total "
            f"{_stash_against(kept, keep)} (summed over the layers: the plan drops, "
            f"recomputes or swaps what the peak cannot hold)")


def _stash_against(kept: int, keep: int) -> str:
    """``kept`` bytes over the iteration against ``keep`` with the probabilities kept, in
    binary units; the exact bytes where the rounded figures would read the same."""
    if kept == keep:
        return (f"{format_size(kept)} ({kept:,} B) over the iteration, as much as with the "
                "probabilities kept")
    if format_size(kept) == format_size(keep):
        return (f"{format_size(kept)} ({kept:,} B) over the iteration, against "
                f"{format_size(keep)} ({keep:,} B) with the probabilities kept")
    return (f"{format_size(kept)} over the iteration, against {format_size(keep)} with the "
            "probabilities kept")
