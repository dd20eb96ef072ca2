"""One causal self-attention layer (projections included), forward + backward: minidl's
``keep`` and ``blockwise:<n>`` forms against PyTorch's ``scaled_dot_product_attention`` with
nn.Linear projections. Each framework runs in its own process (``--framework``); run them
alternated and compare medians:

    for f in torch keep blockwise:128 torch keep blockwise:128; do
        python benchmarks/speed/attention_layer_speed.py --framework $f; done

Defaults: gpt-char's layer (384 wide, 6 heads, T=256, dropout 0.2), batch 16, float32.
"""

from __future__ import annotations

import argparse

import numpy as np
from separate_processes import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", default="keep",
                    help="torch, or minidl's form: keep | blockwise:<n>")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    a = ap.parse_args()
    b, t, d, h = a.batch_size, a.seq, a.dim, a.heads
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    g = rng.standard_normal((b, t, d)).astype(np.float32)
    if a.framework == "torch":
        import torch

        torch.set_num_threads(a.threads)
        qkv, proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(g)

        def step() -> None:
            q, k, v = qkv(xt).split(d, 2)
            q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=a.dropout, is_causal=True)
            proj(o.transpose(1, 2).reshape(b, t, d)).backward(gt)
    else:
        from minidl.layers import Context, MultiHeadAttention

        layer = MultiHeadAttention(d, h, causal=True, dropout=a.dropout)
        params = {k: s.initial_value(rng, np.float32) for k, s in layer.param_specs().items()}
        opts = {"attn": a.framework}
        ctx = Context(options=opts, seed=1)
        shp = [x.shape]
        stash = {k: np.empty(s, dt) for k, (s, dt) in
                 layer.stash_specs(shp, np.float32, options=opts).items()}
        fw = np.empty(layer.forward_workspace_bytes(shp, np.float32, options=opts), np.uint8)
        bw = np.empty(layer.backward_workspace_bytes(shp, np.float32, options=opts), np.uint8)
        y, dx = np.empty_like(x), np.empty_like(x)
        grads = {k: np.empty_like(v) for k, v in params.items()}

        def step() -> None:
            layer.forward(ctx, [x], [y], params, stash, fw if fw.size else None)
            layer.backward(ctx, [g], [dx], [x], [None], params, grads, stash, bw)
    print(f"{a.framework}: {median_ms(step, a.repeats):.1f} ms per forward + backward "
          f"(batch {b}, T={t}, {d} wide, {h} heads, dropout {a.dropout})")


if __name__ == "__main__":
    main()
