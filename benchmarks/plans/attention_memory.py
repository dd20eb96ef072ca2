"""What one attention layer keeps for backward, against the sequence length, in both forms.

One GPT-2-sized self-attention op (768 wide, 12 heads, causal, batch 1, float32) is lowered
for a training step (plan only, no arrays) with the per-op option ``attn`` set to ``keep``
(the probabilities (B, H, T, T) stashed) and to ``blockwise:<n>`` (FlashAttention's form: only
the row log-sum-exp (B, H, T) stashed). Printed per T: the bytes the op keeps for backward as
the lowering declares them (its stash tensors plus the input it retains), their split into
probabilities / log-sum-exp and the rest (q|k|v and the heads' output, linear in T in both
forms), the forward and backward workspaces, and the ratio to the previous T (4x per doubling
is quadratic, 2x linear).

    python benchmarks/plans/attention_memory.py [--seq 512 1024 2048 4096 8192] [--block 128]
                                          [--batch-size 1] [--json]
"""

from __future__ import annotations

import argparse
import json

from minidl import layers as L
from minidl.compile.lowering import lower
from minidl.net.graph import Input, Network


def attention_bytes(seq: int, form: str, batch: int = 1, dim: int = 768,
                    heads: int = 12) -> dict[str, int]:
    """Bytes of the attention op's stash (by name), retained input and workspaces when its
    training step is lowered with option ``attn=form``."""
    x = Input((seq, dim), name="x")
    net = Network(x, L.MultiHeadAttention(dim, heads, causal=True)(x), name="attention")
    low = lower(net, [(batch, seq, dim)], loss=L.SoftmaxCrossEntropy(),
                label_shape=(batch, seq), options={0: {"attn": form}})
    program = low.program
    fwd = next(s for s in program.steps if s.phase == "forward" and s.node == 0)
    bwd = next(s for s in program.steps if s.phase == "backward" and s.node == 0)
    size = {t.id: t.nbytes for t in program.tensors}
    out = {f"stash.{name}": size[t] for name, t in fwd.forward.stash.items()}
    out["retained_input"] = sum(size[t] for t in bwd.forward.inputs)
    out["kept"] = sum(out.values())
    out["forward_workspace"] = size[fwd.access.workspace] if fwd.access.workspace >= 0 else 0
    out["backward_workspace"] = size[bwd.access.workspace] if bwd.access.workspace >= 0 else 0
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--block", type=int, default=128, help="tile size of the blockwise form")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows, last = [], {}
    for seq in args.seq:
        for form in ("keep", f"blockwise:{args.block}"):
            b = attention_bytes(seq, form, args.batch_size)
            growth = b["kept"] / last[form] if form in last else None
            last[form] = b["kept"]
            rows.append({"seq": seq, "form": form, **b, "growth": growth})
    if args.json:
        print(json.dumps(rows))
        return rows
    mib = 2 ** 20
    print(f"one causal attention op, 768 wide, 12 heads, batch {args.batch_size}, float32 "
          "(MiB; growth = kept / kept at the previous T)")
    print(f"{'T':>6} {'form':<14}{'kept':>10}{'probs/lse':>11}{'q|k|v+out+x':>13}"
          f"{'fwd ws':>9}{'bwd ws':>9}{'growth':>8}")
    for r in rows:
        big = r.get("stash.probs", 0) + r.get("stash.lse", 0)
        rest = r["kept"] - big
        g = "" if r["growth"] is None else f"{r['growth']:.2f}x"
        print(f"{r['seq']:>6} {r['form']:<14}{r['kept'] / mib:>10.1f}{big / mib:>11.2f}"
              f"{rest / mib:>13.1f}{r['forward_workspace'] / mib:>9.1f}"
              f"{r['backward_workspace'] / mib:>9.1f}{g:>8}")
    return rows


if __name__ == "__main__":
    main()
