"""gpt-char training step: minidl's engine against a nanoGPT-style PyTorch model on the CPU.

The model of ``minidl train gpt-char`` (6 layers, 6 heads, 384 wide, context ``--seq-len``,
vocabulary 65, dropout 0.2, AdamW lr 1e-3, gradient clipping at 5): one whole training step
(forward, loss, backward, clipping, optimizer update). The PyTorch side is written here (pre-LN
blocks around the attention module of ``minidl.interop.torch_bridge``, through
``scaled_dot_product_attention``, the head tied to the token embedding) and runs in a
process of its own (:class:`minidl.tools.child_process.ChildProcess`), starting from minidl's
weights; the two losses of the first step (dropout off) are printed side by side to show they
compute the same function. torch is never imported in the process that times minidl (checked).

Protocol: ``--rounds`` rounds of ``--block`` + 1 minidl steps, a pause, the same in PyTorch's
process, a pause; the first step of each block is not counted; figures are medians and their
ratio.

    python benchmarks/speed/gpt_bench.py [--rounds 5] [--block 3] [--batch-size 16] [--seq-len 256]
                                   [--memory none] [--torch-threads N]
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np
from separate_processes import require_torch_absent

from minidl.tools.child_process import ChildProcess, alternate


class MinidlGPT:
    """gpt-char in minidl's Trainer, stepped here."""

    def __init__(self, batch: int, seq_len: int, memory: str, dropout: float) -> None:
        from dataclasses import replace

        import minidl
        from minidl.analysis.dryrun import auto_device_memory
        from minidl.net.optim import AdamW
        from minidl.zoo.transformers import CONFIGS, gpt

        config = replace(CONFIGS["gpt-char"], context=seq_len, dropout=dropout)
        self.net = gpt(config, name="gpt-char")
        need = auto_device_memory(self.net, batch, memory, "adamw", (seq_len,))
        self.trainer = minidl.Trainer(self.net, AdamW(self.net.parameters(), lr=1e-3),
                                      memory=memory, device_memory=need, clip_grad_norm=5.0)
        rng = np.random.default_rng(0)
        self.x = rng.integers(0, config.vocab, (batch, seq_len))
        self.y = rng.integers(0, config.vocab, (batch, seq_len))

    def weights(self) -> dict[str, np.ndarray]:
        return {n: np.array(v) for n, v in self.net.state_dict().items()}

    def loss(self) -> float:
        return self.trainer.evaluate(self.x, self.y, len(self.x))[0]

    def time_steps(self, count: int) -> list[float]:
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            self.trainer.step(self.x, self.y)
            times.append(time.perf_counter() - t0)
        return times


class TorchGPT:
    """The same model in PyTorch (nanoGPT's layout, minidl's attention), built and timed in
    its own process."""

    def __init__(self, weights: dict[str, np.ndarray], batch: int, seq_len: int,
                 dropout: float, threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = _torch_model(torch, 6, 6, 384, seq_len, 65, dropout)
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()},
                                   strict=True)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        rng = np.random.default_rng(0)
        self.x = torch.from_numpy(rng.integers(0, 65, (batch, seq_len)))
        self.y = torch.from_numpy(rng.integers(0, 65, (batch, seq_len)))

    def describe(self) -> str:
        return f"torch {self.torch.__version__}, {self.torch.get_num_threads()} threads"

    def loss(self) -> float:
        self.model.eval()
        with self.torch.no_grad():
            out = self.model(self.x)
        self.model.train()
        return float(self.torch.nn.functional.cross_entropy(out.reshape(-1, 65),
                                                            self.y.reshape(-1)))

    def time_steps(self, count: int) -> list[float]:
        torch, times = self.torch, []
        for _ in range(count):
            t0 = time.perf_counter()
            self.opt.zero_grad(set_to_none=True)
            out = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, 65), self.y.reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            self.opt.step()
            times.append(time.perf_counter() - t0)
        return times


def _torch_model(torch, layers: int, heads: int, dim: int, context: int, vocab: int,
                 dropout: float):
    """nanoGPT's GPT with the attention of ``minidl.interop.torch_bridge`` (minidl's
    ``MultiHeadAttention`` in PyTorch: ``qkv``, ``proj``, ``scaled_dot_product_attention``),
    so the state dict's names are minidl's (transformer.h.0.attn.qkv.weight, ...)."""
    from minidl.interop.torch_bridge import torch_self_attention

    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(dim)
            self.attn = torch_self_attention(torch, dim, heads, True, dropout, True)
            self.ln_2 = nn.LayerNorm(dim)
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(dim, 4 * dim),
                                      "c_proj": nn.Linear(4 * dim, dim)})
            self.drop = nn.Dropout(dropout)

        def forward(self, x):
            x = x + self.drop(self.attn(self.ln_1(x)))
            h = self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))
            return x + self.drop(h)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(vocab, dim), "wpe": nn.Embedding(context, dim),
                "h": nn.ModuleList(Block() for _ in range(layers)), "ln_f": nn.LayerNorm(dim)})
            self.drop = nn.Dropout(dropout)

        def forward(self, idx):
            tr = self.transformer
            x = self.drop(tr["wte"](idx) + tr["wpe"](torch.arange(idx.shape[1])))
            for block in tr["h"]:
                x = block(x)
            return tr["ln_f"](x) @ tr["wte"].weight.T

    return GPT()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="blocks per framework")
    ap.add_argument("--block", type=int, default=3,
                    help="counted steps per block (one more runs first, not counted)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--memory", default="none", help="minidl's memory spec")
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (default: torch's own choice)")
    ap.add_argument("--no-torch", action="store_true", help="time minidl alone")
    args = ap.parse_args(argv)
    for name in ("rounds", "block", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    minidl_side = MinidlGPT(args.batch_size, args.seq_len, args.memory, args.dropout)
    torch_side = None
    if not args.no_torch and importlib.util.find_spec("torch") is not None:
        torch_side = ChildProcess(TorchGPT, minidl_side.weights(), args.batch_size,
                                  args.seq_len, args.dropout, args.torch_threads)
    try:
        loss_m = minidl_side.loss()
        out: dict = {"batch_size": args.batch_size, "seq_len": args.seq_len,
                     "memory": args.memory, "minidl_loss": loss_m}
        if torch_side is not None:
            out["torch"] = torch_side.call("describe")
            out["torch_loss"] = torch_side.call("loss")
            print(f"{out['torch']} (in a process of its own); first losses (eval) minidl "
                  f"{loss_m:.6f}, torch {out['torch_loss']:.6f}")
        times = alternate(args.rounds, args.block, minidl_side.time_steps, torch_side,
                          "time_steps", before_round=require_torch_absent)
        require_torch_absent()
    finally:
        if torch_side is not None:
            torch_side.close()
    out["minidl_step_s"] = float(np.median(times["minidl"]))
    line = (f"gpt-char batch {args.batch_size} x {args.seq_len}, memory {args.memory!r}: "
            f"minidl {1000 * out['minidl_step_s']:.0f} ms")
    if torch_side is not None:
        out["torch_step_s"] = float(np.median(times["torch"]))
        out["ratio"] = out["minidl_step_s"] / out["torch_step_s"]
        line += (f", PyTorch {1000 * out['torch_step_s']:.0f} ms per step (medians of "
                 f"{len(times['minidl'])} / {len(times['torch'])}): ratio {out['ratio']:.2f}")
    print(line)
    return out


if __name__ == "__main__":
    main()
