"""What memory passes may do with an op: capabilities as typed data, never op names.

Layers declare them with the enums of :mod:`minidl.kernels.vocabulary`
(``recompute_cost = RecomputeCost.EXPENSIVE``, ``backward_from = (StashEncoding.SIGN,)``;
layers import nothing of memory); lowering turns them into an :class:`OpCaps` with
:func:`op_caps`, which refuses an unknown value, and puts it on every step. Passes read
``step.op.caps`` only: a new layer gets every strategy by declaring its capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...kernels.vocabulary import RecomputeCost, StashEncoding

__all__ = ["OPTIONS", "OpCaps", "RecomputeCost", "StashEncoding", "op_caps"]


@dataclass(frozen=True)
class OpCaps:
    """Capabilities of one op (see the enums); the defaults promise nothing."""

    cost: RecomputeCost = RecomputeCost.CHEAP
    backward_from: frozenset[StashEncoding] = frozenset()
    #: Its outputs are mostly zeros (ReLU): worth keeping sparse when a convolution keeps them.
    sparse_output: bool = False
    #: A convolution: vDNN's ``swap=conv`` offloads its inputs; Gist keeps the ReLU outputs it
    #: retains sparse.
    convolution: bool = False
    #: Per-op options the plan may set on the op's steps (:data:`OPTIONS`).
    options: frozenset[str] = frozenset()


#: Per-op options a pass may set: ``"bptt"``, a fused RNN's BPTT schedule (:mod:`.bptt_options`);
#: ``"device_kind"``, the kind of device the program is lowered for (``cpu`` | ``cuda``), for
#: layers whose workspace differs per kind; ``"conv_ws"``, a cap in bytes on a convolution's
#: workspace, which picks its algorithm and chunking (:mod:`.workspace_options`); ``"attn"``,
#: attention's memory form, probabilities kept or blockwise (:mod:`.attention_options`).
OPTIONS = ("bptt", "device_kind", "conv_ws", "attn")


def op_caps(owner: str, cost: str = RecomputeCost.CHEAP, backward_from: tuple[str, ...] = (),
            sparse_output: bool = False, convolution: bool = False,
            options: tuple[str, ...] = ()) -> OpCaps:
    """:class:`OpCaps` from plain declared values; ``ValueError`` naming ``owner`` and the
    valid values for anything unknown."""
    try:
        c = RecomputeCost(cost)
    except ValueError:
        raise ValueError(f"{owner}: unknown recompute cost {cost!r}; valid: "
                         f"{', '.join(v.value for v in RecomputeCost)}") from None
    encs = set()
    for e in backward_from:
        try:
            encs.add(StashEncoding(e))
        except ValueError:
            raise ValueError(f"{owner}: unknown stash encoding {e!r} to run backward from; "
                             f"valid: {', '.join(v.value for v in StashEncoding)}") from None
    for o in options:
        if o not in OPTIONS:
            raise ValueError(f"{owner}: unknown per-op option {o!r}; valid: {', '.join(OPTIONS)}")
    return OpCaps(c, frozenset(encs), bool(sparse_output), bool(convolution),
                  frozenset(options))
