"""char-LSTM forward+backward: minidl's per-step RNN layers against PyTorch CPU.

Embedding(65, 256) -> 2-layer LSTM(256) -> Linear(256, 65) -> softmax cross-entropy over all
steps, batch 32, sequence 64, float32 (the model of ``minidl bench char-lstm``).

The minidl side drives the layers by hand the way the engine unrolls them: per RNN layer one
``RNNInputProjection`` and 64 ``LSTMCell`` calls, each on its own preallocated output, stash,
gradient and workspace buffers. Embedding, Linear and the loss are plain NumPy. What the engine
will add is timed apart as ``glue``: summing the shared ``weight_hh`` / ``bias_hh`` gradients
of the steps, summing the two gradients of each h_t (next step and layer above), stacking the
top layer's h_t for the Linear. Python call overhead of the 256 layer calls is included.
Both sides start from the same weights; their gradients are compared. The two run in
alternating blocks of ``--block`` steps, the first step of each block discarded: stepwise
alternation would time each library with the other's idle BLAS / OpenMP threads still spinning
on the 2 cores (it made torch look ~1.4x slower than alone). Figures are medians.

    python benchmarks/rnn_bench.py [--rounds 8] [--block 6] [--batch-size 32] [--seq-len 64]
                                   [--threads N]

``--threads N`` limits NumPy's BLAS (through threadpoolctl) and torch to N threads each.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

VOCAB, EMBED, HIDDEN, LAYERS = 65, 256, 256, 2


class Timer:
    """Accumulates wall time per part within one step; ``laps`` keeps one sum per step."""

    def __init__(self) -> None:
        self.laps: dict[str, list[float]] = {}
        self.cur: dict[str, float] = {}
        self.t = time.perf_counter()

    def start(self) -> None:
        self.cur = {}
        self.t = time.perf_counter()

    def tick(self, name: str) -> None:
        t = time.perf_counter()
        self.cur[name] = self.cur.get(name, 0.0) + t - self.t
        self.t = t

    def end(self) -> None:
        for k, v in self.cur.items():
            self.laps.setdefault(k, []).append(v)


class MinidlCharLSTM:
    """Buffers and parameters of the unrolled model; ``step`` is one forward + backward."""

    def __init__(self, batch: int, seq: int, rng: np.random.Generator) -> None:
        from minidl.layers.base import Context
        from minidl.layers.lstm import LSTMCell
        from minidl.layers.rnn_projection import RNNInputProjection

        dt = np.dtype(np.float32)
        n, t_len, h = batch, seq, HIDDEN
        self.n, self.t_len, self.ctx = n, t_len, Context()
        self.embed = rng.standard_normal((VOCAB, EMBED)).astype(dt)
        bound = 1 / np.sqrt(h)
        self.lin_w = rng.uniform(-bound, bound, (VOCAB, h)).astype(dt)
        self.lin_b = rng.uniform(-bound, bound, VOCAB).astype(dt)
        self.emb_out = np.empty((n, t_len, EMBED), dt)
        self.d_emb = np.empty((n, t_len, EMBED), dt)
        self.g_embed = np.empty_like(self.embed)
        self.layers = []
        for k in range(LAYERS):
            in_size = EMBED if k == 0 else h
            proj = RNNInputProjection(in_size, 4 * h, t_len, step_inputs=k > 0, hidden_size=h)
            cell = LSTMCell(h)
            proj.name, cell.name = f"proj{k}", f"lstm{k}"
            in_shapes = [(n, t_len, in_size)] if k == 0 else [(n, in_size)] * t_len
            cell_shapes = [(n, 4 * h), (n, h), (n, h)]
            ws_p = max(proj.forward_workspace_bytes(in_shapes, dt),
                       proj.backward_workspace_bytes(in_shapes, dt))
            ws_c = max(cell.forward_workspace_bytes(cell_shapes, dt),
                       cell.backward_workspace_bytes(cell_shapes, dt))
            pp = {name: s.initial_value(rng, dt) for name, s in proj.param_specs().items()}
            cp = {name: s.initial_value(rng, dt) for name, s in cell.param_specs().items()}
            gshape = cell.stash_specs(cell_shapes, dt)["gates"][0]
            self.layers.append({
                "proj": proj, "cell": cell, "pp": pp, "cp": cp,
                "gp": {name: np.empty_like(v) for name, v in pp.items()},
                "gc": {name: np.empty_like(v) for name, v in cp.items()},  # accumulated
                "gc_step": {name: np.empty_like(v) for name, v in cp.items()},
                "ws_p": np.empty(ws_p, np.uint8), "ws_c": np.empty(max(ws_c, 1), np.uint8),
                "gx": [np.empty((n, 4 * h), dt) for _ in range(t_len)],
                "dgx": [np.empty((n, 4 * h), dt) for _ in range(t_len)],
                "h": [np.empty((n, h), dt) for _ in range(t_len)],
                "c": [np.empty((n, h), dt) for _ in range(t_len)],
                "gates": [np.empty(gshape, dt) for _ in range(t_len)],
                "dh_in": [np.empty((n, h), dt) for _ in range(t_len)],  # grads from above
                "h0": np.zeros((n, h), dt), "c0": np.zeros((n, h), dt),
                "dh": np.empty((n, h), dt), "dh_prev": np.empty((n, h), dt),
                "dc": np.empty((n, h), dt), "dc_prev": np.empty((n, h), dt),
            })
        self.hs = np.empty((n, t_len, h), dt)
        self.dhs = np.empty((n * t_len, h), dt)
        self.logits = np.empty((n * t_len, VOCAB), dt)
        self.dlogits = np.empty_like(self.logits)
        self.g_lin_w = np.empty_like(self.lin_w)
        self.g_lin_b = np.empty_like(self.lin_b)

    def step(self, tokens: np.ndarray, targets: np.ndarray, tm: Timer) -> float:
        ctx, t_len, n = self.ctx, self.t_len, self.n
        tm.start()
        np.take(self.embed, tokens, axis=0, out=self.emb_out)
        tm.tick("embedding")
        inputs = [self.emb_out]
        for k, L in enumerate(self.layers):
            L["proj"].forward(ctx, inputs, L["gx"], L["pp"], {}, L["ws_p"])
            tm.tick(f"proj{k}.fwd")
            h, c, cell, cp, ws = L["h0"], L["c0"], L["cell"], L["cp"], L["ws_c"]
            for t in range(t_len):
                cell.forward(ctx, [L["gx"][t], h, c], [L["h"][t], L["c"][t]], cp,
                             {"gates": L["gates"][t]}, ws)
                h, c = L["h"][t], L["c"][t]
            tm.tick(f"lstm{k}.fwd")
            inputs = L["h"]

        top = self.layers[-1]
        for t in range(t_len):
            self.hs[:, t] = top["h"][t]
        tm.tick("glue")
        hs2 = self.hs.reshape(n * t_len, HIDDEN)
        np.matmul(hs2, self.lin_w.T, out=self.logits)
        self.logits += self.lin_b
        m = self.logits.max(axis=1, keepdims=True)
        np.subtract(self.logits, m, out=self.dlogits)
        np.exp(self.dlogits, out=self.dlogits)
        s = self.dlogits.sum(axis=1, keepdims=True)
        tgt = targets.reshape(-1)
        rows = np.arange(tgt.size)
        loss = float(np.mean(np.log(s[:, 0]) + m[:, 0] - self.logits[rows, tgt]))
        self.dlogits /= s
        self.dlogits[rows, tgt] -= 1
        self.dlogits *= np.float32(1 / tgt.size)
        np.matmul(self.dlogits.T, hs2, out=self.g_lin_w)
        np.sum(self.dlogits, axis=0, out=self.g_lin_b)
        np.matmul(self.dlogits, self.lin_w, out=self.dhs)
        tm.tick("linear+ce")
        dhs3 = self.dhs.reshape(n, t_len, HIDDEN)
        for t in range(t_len):
            np.copyto(top["dh_in"][t], dhs3[:, t])
        tm.tick("glue")

        for k in reversed(range(LAYERS)):
            L = self.layers[k]
            cell, cp, ws = L["cell"], L["cp"], L["ws_c"]
            dh, dh_prev, dc, dc_prev = L["dh"], L["dh_prev"], L["dc"], L["dc_prev"]
            dh.fill(0)
            dc.fill(0)
            for t in reversed(range(t_len)):
                np.add(dh, L["dh_in"][t], out=dh)  # fan-out of h_t: next step + above
                gc = L["gc"] if t == t_len - 1 else L["gc_step"]
                tm.tick("glue")
                h_prev = L["h"][t - 1] if t else L["h0"]
                c_prev = L["c"][t - 1] if t else L["c0"]
                cell.backward(ctx, [dh, dc], [L["dgx"][t], dh_prev, dc_prev],
                              [None, h_prev, c_prev], [None, L["c"][t]], cp, gc,
                              {"gates": L["gates"][t]}, ws)
                tm.tick(f"lstm{k}.bwd")
                if t != t_len - 1:  # shared parameters: the engine sums the steps' gradients
                    for name, g in gc.items():
                        np.add(L["gc"][name], g, out=L["gc"][name])
                dh, dh_prev = dh_prev, dh
                dc, dc_prev = dc_prev, dc
                tm.tick("glue")
            L["dh"], L["dh_prev"], L["dc"], L["dc_prev"] = dh, dh_prev, dc, dc_prev
            if k > 0:
                below = self.layers[k - 1]
                L["proj"].backward(ctx, L["dgx"], below["dh_in"], below["h"], [], L["pp"],
                                   L["gp"], {}, L["ws_p"])
            else:
                L["proj"].backward(ctx, L["dgx"], [self.d_emb], [self.emb_out], [], L["pp"],
                                   L["gp"], {}, L["ws_p"])
            tm.tick(f"proj{k}.bwd")
        self.g_embed.fill(0)
        np.add.at(self.g_embed, tokens.reshape(-1), self.d_emb.reshape(-1, EMBED))
        tm.tick("embedding")
        tm.end()
        return loss

    def grads(self) -> dict[str, np.ndarray]:
        out = {"embed": self.g_embed, "lin_w": self.g_lin_w, "lin_b": self.g_lin_b}
        for k, L in enumerate(self.layers):
            out[f"weight_ih_l{k}"] = L["gp"]["weight"]
            out[f"bias_ih_l{k}"] = L["gp"]["bias"]
            out[f"weight_hh_l{k}"] = L["gc"]["weight_hh"]
            out[f"bias_hh_l{k}"] = L["gc"]["bias_hh"]
        return out


class TorchCharLSTM:
    def __init__(self, m: MinidlCharLSTM) -> None:
        import torch

        self.torch = torch
        self.emb = torch.nn.Embedding(VOCAB, EMBED)
        self.lstm = torch.nn.LSTM(EMBED, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.lin = torch.nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            self.emb.weight.copy_(torch.from_numpy(m.embed))
            self.lin.weight.copy_(torch.from_numpy(m.lin_w))
            self.lin.bias.copy_(torch.from_numpy(m.lin_b))
            for k, L in enumerate(m.layers):
                getattr(self.lstm, f"weight_ih_l{k}").copy_(torch.from_numpy(L["pp"]["weight"]))
                getattr(self.lstm, f"bias_ih_l{k}").copy_(torch.from_numpy(L["pp"]["bias"]))
                getattr(self.lstm, f"weight_hh_l{k}").copy_(torch.from_numpy(L["cp"]["weight_hh"]))
                getattr(self.lstm, f"bias_hh_l{k}").copy_(torch.from_numpy(L["cp"]["bias_hh"]))
        self.params = [*self.emb.parameters(), *self.lstm.parameters(), *self.lin.parameters()]

    def step(self, tokens: np.ndarray, targets: np.ndarray, tm: Timer) -> float:
        torch = self.torch
        x, y = torch.from_numpy(tokens), torch.from_numpy(targets.reshape(-1))
        tm.start()
        for p in self.params:
            p.grad = None
        e = self.emb(x)
        tm.tick("embedding.fwd")
        out, _ = self.lstm(e)
        tm.tick("lstm.fwd")
        loss = torch.nn.functional.cross_entropy(self.lin(out).reshape(-1, VOCAB), y)
        tm.tick("linear+ce.fwd")
        loss.backward()
        tm.tick("backward (all)")
        tm.end()
        return float(loss.detach())

    def grads(self) -> dict[str, np.ndarray]:
        out = {"embed": self.emb.weight.grad, "lin_w": self.lin.weight.grad,
               "lin_b": self.lin.bias.grad}
        for k in range(LAYERS):
            for name in ("weight_ih", "bias_ih", "weight_hh", "bias_hh"):
                out[f"{name}_l{k}"] = getattr(self.lstm, f"{name}_l{k}").grad
        return {k: v.numpy() for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="blocks per library")
    ap.add_argument("--block", type=int, default=6, help="steps per block (first discarded)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads")
    args = ap.parse_args(argv)
    if args.threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
        try:
            import torch

            torch.set_num_threads(args.threads)
        except ImportError:
            pass

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (args.batch_size, args.seq_len))
    targets = rng.integers(0, VOCAB, (args.batch_size, args.seq_len))
    model = MinidlCharLSTM(args.batch_size, args.seq_len, rng)
    runners = {"minidl": model}
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        runners["torch"] = TorchCharLSTM(model)
        losses = {k: r.step(tokens, targets, Timer()) for k, r in runners.items()}
        gm, gt = model.grads(), runners["torch"].grads()
        err = max(float(np.abs(gm[k] - gt[k]).max() / (np.abs(gt[k]).max() + 1e-30))
                  for k in gt)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; losses "
              f"{losses['minidl']:.6f} / {losses['torch']:.6f}; max relative gradient "
              f"difference {err:.1e}")

    timers = {k: Timer() for k in runners}
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            for i in range(args.block):
                t0 = time.perf_counter()
                runner.step(tokens, targets, timers[name])
                dt = time.perf_counter() - t0
                if i == 0:  # warm-up after the switch: drop its time and parts
                    for v in timers[name].laps.values():
                        v.pop()
                else:
                    times[name].append(dt)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    kept = args.rounds * (args.block - 1)
    print(f"step (batch {args.batch_size}, seq {args.seq_len}, median of {kept} steps in "
          f"{args.rounds} alternating blocks; load average {load}):")
    for k, v in med.items():
        q1, q3 = np.percentile(times[k], [25, 75]) * 1e3
        print(f"  {k:7s} {v:7.2f} ms   (IQR {q1:.2f}-{q3:.2f})")
    if torch is not None:
        print(f"  ratio minidl/torch: {med['minidl'] / med['torch']:.2f}x")
    for name, tmr in timers.items():
        parts = {k: float(np.median(v)) * 1e3 for k, v in tmr.laps.items()}
        print(f"{name} parts (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                        parts.items()))
        if name == "minidl":
            rnn = sum(v for k, v in parts.items() if k.startswith(("proj", "lstm")))
            print(f"  minidl RNN layer calls (proj + lstm, fwd + bwd): {rnn:.2f} ms")


if __name__ == "__main__":
    main()
