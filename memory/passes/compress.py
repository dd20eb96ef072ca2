"""``binarize``, ``sparse``, ``dpr=fp16|bf16|fp8``: feature maps kept for backward stored
encoded (Gist, Jain et al. 2018; cDMA's zero-value compression).

A program rewrite, like recomputation: an *encode* step right after a tensor's last forward
use writes its encoded form (category ``encoded``) so the dense tensor dies there; either a
*decode* step before its first backward use rebuilds a dense clone that the backward steps
read, or the backward step itself consumes the encoded form:

* ``binarize`` — the output of an op whose backward can start from its sign (ReLU) and that
  only that backward needs (ReLU→Pool) is kept as a 1-bit sign mask; the argmax stash of an op
  whose backward can start from it packed (max-pool) is kept in the fewest bits its window
  needs (2 bits for 2×2). The layer's ``backward_from_encoded`` runs from those. Lossless.
* ``sparse`` — a mostly-zero output (ReLU) a convolution keeps (ReLU→Conv) is stored in the
  smallest of CSR with narrow column indices (Gist's SSDC) and a bitmask plus non-zeros
  (ZVC), never larger than dense; decoded before the convolution's backward. Lossless; its
  size depends on the data, so plans use measured densities when the engine has them and an
  assumed density before (the plan says which).
* ``dpr`` — every other feature map kept for backward is stored at reduced precision and
  decoded (lossy: opt-in; the forward pass stays fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...kernels.codecs import bitpack, precision, sparse
from ...kernels.pooling import poolidx
from ..ir.capabilities import StashEncoding
from ..ir.names import Category, Codec, Phase, Role
from ..ir.payloads import CodecStep, CompressionSummary, EncodedInput, PoolWindow
from ..ir.precision import is_float, itemsize
from ..ir.program import Program, Step, TensorSpec
from ..ir.step_parts import OpTraits, StepAccess

#: The encoding a layer's backward starts from, for the codecs it consumes directly.
CODEC_ENCODING = {Codec.SIGN: StashEncoding.SIGN, Codec.POOLIDX: StashEncoding.PACKED_ARGMAX}
#: Density (fraction of non-zeros) assumed for ReLU outputs before any is measured.
ASSUMED_DENSITY = 0.5


def _backward_readers(program: Program) -> dict[int, list[Step]]:
    out: dict[int, list[Step]] = {}
    for st in program.steps:
        if st.phase in (Phase.BACKWARD, Phase.RECOMPUTE):
            for t in st.access.reads:
                out.setdefault(t, []).append(st)
    return out


def _last_forward_use(program: Program) -> dict[int, int]:
    last: dict[int, int] = {}
    for st in program.steps:
        if st.phase == Phase.FORWARD:
            for t in (*st.access.reads, *st.access.writes):
                last[t] = st.index
    return last


def encoded_size(codec: Codec, spec: TensorSpec, window: PoolWindow | None,
                 density: float | None) -> int:
    """Bytes of ``spec`` encoded with ``codec`` (sparse: at ``density``; packed argmax
    indices: of a max-pool's ``window``)."""
    n = math.prod(spec.shape)
    if codec == Codec.SIGN:
        return bitpack.packed_nbytes(n)
    if codec == Codec.POOLIDX:
        return poolidx.packed_index_nbytes(n, poolidx.index_bits(window.size))
    if codec == Codec.SPARSE:
        return sparse.choose_encoding(n, int(math.ceil(n * density)),
                                      itemsize(spec.dtype)).nbytes
    return precision.encoded_nbytes(n, codec)


def compress_program(program: Program, binarize: bool = False, use_sparse: bool = False,
                     dpr: str | None = None,
                     densities: dict[str, float] | None = None) -> Program:
    """Rewrite ``program`` so the chosen feature maps are kept encoded between forward and
    backward (see module docstring). ``densities`` maps tensor names to measured fractions of
    non-zeros."""
    if not program.training:
        return program
    readers = _backward_readers(program)
    plan = _choose_codecs(program, readers, binarize, use_sparse, dpr)
    if not plan:
        return program
    forms = _EncodedForms.build(program, plan, densities or {})
    steps = _rewritten_steps(program, plan, forms, readers)
    rewrites = replace(program.rewrites, compression=CompressionSummary(
        encoded={forms.tensors[t].name: codec for t, (codec, _) in plan.items()},
        sparse_densities=dict(forms.densities)))
    return Program(tensors=forms.tensors, steps=steps, inputs=list(program.inputs),
                   loss=program.loss, training=program.training, rewrites=rewrites,
                   alignment=program.alignment)


#: Tensor -> (codec, the max-pool window packed indices need, else None): what the rewrite
#: encodes, in the order chosen.
_Choice = dict[int, tuple[Codec, PoolWindow | None]]


def _choose_codecs(program: Program, readers: dict[int, list[Step]], binarize: bool,
                   use_sparse: bool, dpr: str | None) -> _Choice:
    """The tensors to keep encoded and their codecs: per forward step the lossless ones
    (``binarize``, ``sparse``), then reduced precision (``dpr``) for the remaining feature
    maps."""
    plan: _Choice = {}
    for st in program.steps:
        if st.phase == Phase.FORWARD:
            _choose_lossless(program, st, readers, binarize, use_sparse, plan)
    if dpr:
        _choose_reduced_precision(program, readers, dpr, plan)
    return plan


def _choose_lossless(program: Program, st: Step, readers: dict[int, list[Step]],
                     binarize: bool, use_sparse: bool, plan: _Choice) -> None:
    """Add to ``plan`` forward step ``st``'s outputs kept as signs, its packed argmax stash,
    or its sparse output."""
    outs = [t for t in st.access.writes if program.tensors[t].role == Role.VALUE]
    from_enc = st.op.caps.backward_from
    if binarize and StashEncoding.SIGN in from_enc and outs:
        v = outs[0]
        rs = readers.get(v, [])
        if rs and all(r.phase == Phase.BACKWARD and r.node == st.node for r in rs):
            plan[v] = (Codec.SIGN, None)
            return
    if binarize and StashEncoding.PACKED_ARGMAX in from_enc:
        for t in st.access.writes:
            if program.tensors[t].role == Role.STASH and t in readers:
                plan[t] = (Codec.POOLIDX, st.op.facts.pool)
    if use_sparse and st.op.caps.sparse_output and outs:
        v = outs[0]
        if any(r.op.caps.convolution for r in readers.get(v, [])):
            plan[v] = (Codec.SPARSE, None)


def _choose_reduced_precision(program: Program, readers: dict[int, list[Step]], dpr: str,
                              plan: _Choice) -> None:
    """Add to ``plan`` every other floating-point feature map a forward step makes and
    backward reads, at precision ``dpr``, where its codes are narrower than the map's dtype
    (fp8 below a half map; in mixed precision the float32 maps take fp16 / bf16 too)."""
    fed = set(program.inputs)
    producer = {t: st for st in program.steps if st.phase == Phase.FORWARD
                for t in st.access.writes}
    for t in readers:
        spec = program.tensors[t]
        if t in plan or t in fed or spec.role != Role.VALUE \
                or spec.category != Category.FEATURE_MAP:
            continue
        if not is_float(spec.dtype) or t not in producer \
                or itemsize(spec.dtype) <= precision.code_dtype(dpr).itemsize:
            continue  # (fp16 / bf16 codes of a half feature map would save nothing)
        plan[t] = (Codec.of(dpr), None)


@dataclass
class _EncodedForms:
    """The rewritten program's tensors: each chosen tensor's encoded form (``enc_of``) and,
    unless backward reads the encoding itself, its decoded clone (``dec_of``); and the sparse
    tensors' densities (None: assumed)."""

    tensors: list[TensorSpec]
    enc_of: dict[int, int]
    dec_of: dict[int, int]
    densities: list[tuple[str, float | None]]

    @classmethod
    def build(cls, program: Program, plan: _Choice,
              densities: dict[str, float]) -> _EncodedForms:
        forms = cls(list(program.tensors), {}, {}, [])
        tensors = forms.tensors
        for t, (codec, window) in plan.items():
            spec = tensors[t]
            dens = None
            if codec == Codec.SPARSE:
                dens = densities.get(spec.name)
                forms.densities.append((spec.name, dens))
                dens = ASSUMED_DENSITY if dens is None else dens
            nb = encoded_size(codec, spec, window, dens)
            forms.enc_of[t] = len(tensors)
            tensors.append(TensorSpec(len(tensors), f"{spec.name}.{codec}", (nb,), "uint8",
                                      "encoded", "encoded", spec.layer, of=t))
            if codec not in (Codec.SIGN, Codec.POOLIDX):
                forms.dec_of[t] = len(tensors)
                tensors.append(spec.clone(len(tensors), f"{spec.name}@decoded"))
        return forms


def _rewritten_steps(program: Program, plan: _Choice, forms: _EncodedForms,
                     readers: dict[int, list[Step]]) -> list[Step]:
    """The program's steps with an encode step after each chosen tensor's last forward use,
    a decode step before its first backward reader (where decoded), and backward steps
    reading the decoded clones or the encoding (renumbered)."""
    tensors, enc_of, dec_of = forms.tensors, forms.enc_of, forms.dec_of
    last_fwd = _last_forward_use(program)
    encode_after: dict[int, list[int]] = {}
    for t in plan:
        encode_after.setdefault(last_fwd[t], []).append(t)
    decode_before: dict[int, list[int]] = {}
    for t in dec_of:
        decode_before.setdefault(readers[t][0].index, []).append(t)

    steps: list[Step] = []

    def emit(st: Step) -> None:
        steps.append(replace(st, index=len(steps)))

    for i, st in enumerate(program.steps):
        for t in decode_before.get(i, []):
            emit(Step(0, "decode", tensors[t].layer, "decode", -1,
                      StepAccess((enc_of[t],), (dec_of[t],)),
                      op=OpTraits(codec=CodecStep(plan[t][0], t))))
        if st.phase in (Phase.BACKWARD, Phase.RECOMPUTE):
            st = _reading_encoded(st, plan, forms)
        emit(st)
        for t in encode_after.get(i, []):
            codec, window = plan[t]
            emit(Step(0, "encode", tensors[t].layer, "encode", -1, StepAccess((t,), (enc_of[t],)),
                      op=OpTraits(codec=CodecStep(codec, t, window))))
    return steps


def _reading_encoded(st: Step, plan: _Choice, forms: _EncodedForms) -> Step:
    """Backward (or recomputing) step ``st`` reading decoded clones, or the encoding itself
    where its layer's backward starts from it."""
    enc_of, dec_of = forms.enc_of, forms.dec_of
    decoded = {t: dec_of[t] for t in st.access.reads if t in dec_of}
    consumed = [t for t in st.access.reads if t in enc_of and t not in dec_of]
    if consumed:  # read encoded: the layer's backward starts from the encoding
        t = consumed[0]
        reads = tuple(enc_of[r] if r == t else r for r in st.access.reads)
        st = replace(st, access=replace(st.access, reads=reads), op=replace(
            st.op, from_encoded=EncodedInput(CODEC_ENCODING[plan[t][0]], enc_of[t])))
    return st.remapped(decoded)
