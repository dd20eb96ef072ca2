"""char-LSTM forward+backward: minidl's per-step RNN layers against PyTorch CPU.

Embedding(65, 256) -> 2-layer LSTM(256) -> Linear(256, 65) -> softmax cross-entropy over all
steps, batch 32, sequence 64, float32 (the model of ``minidl bench char-lstm``).

The minidl side drives the layers by hand the way the engine unrolls them: per RNN layer one
``RNNInputProjection`` and 64 ``LSTMCell`` calls, each on its own preallocated output, stash,
gradient and workspace buffers. Embedding, Linear and the loss are plain NumPy. What the engine
will add is timed apart as ``glue``: summing the shared ``weight_hh`` / ``bias_hh`` gradients
of the steps, summing the two gradients of each h_t (next step and layer above), stacking the
top layer's h_t for the Linear. Python call overhead of the 256 layer calls is included.
The PyTorch side (``torch.nn.LSTM``, forward + backward, no optimizer) lives in a process of
its own (``minidl.tools.child_process.ChildProcess``): torch is never imported in the process that
times minidl (checked), since each runtime's idle BLAS / OpenMP / Numba threads spinning after
its work slow the other. Both sides start from the same weights and batch; their losses and
gradients are compared after one step each.

Protocol: ``--rounds`` rounds of a block of ``--block`` + 1 minidl steps, a pause, the same
block in PyTorch's process, a pause; the first step of each block is not counted (with its
parts), and figures are medians. (``minidl bench char-lstm --compare-torch`` compares whole
training steps through the engine, with ``minidl.tools.bench.TorchProcess``.)

    python benchmarks/speed/rnn_bench.py [--rounds 8] [--block 5] [--batch-size 32] [--seq-len 64]
                                   [--threads N]

``--threads N`` limits NumPy's BLAS (through threadpoolctl) here and torch in its process to N
threads each.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable

import numpy as np
from separate_processes import require_torch_absent

from minidl.tools.child_process import ChildProcess, alternate

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
        from minidl.layers.recurrent.lstm import LSTMCell
        from minidl.layers.recurrent.rnn_projection import RNNInputProjection

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

    def weights(self) -> dict[str, np.ndarray]:
        """The trainable weights, named as in :meth:`grads`."""
        out = {"embed": self.embed, "lin_w": self.lin_w, "lin_b": self.lin_b}
        for k, L in enumerate(self.layers):
            out[f"weight_ih_l{k}"] = L["pp"]["weight"]
            out[f"bias_ih_l{k}"] = L["pp"]["bias"]
            out[f"weight_hh_l{k}"] = L["cp"]["weight_hh"]
            out[f"bias_hh_l{k}"] = L["cp"]["bias_hh"]
        return out

    def grads(self) -> dict[str, np.ndarray]:
        out = {"embed": self.g_embed, "lin_w": self.g_lin_w, "lin_b": self.g_lin_b}
        for k, L in enumerate(self.layers):
            out[f"weight_ih_l{k}"] = L["gp"]["weight"]
            out[f"bias_ih_l{k}"] = L["gp"]["bias"]
            out[f"weight_hh_l{k}"] = L["gc"]["weight_hh"]
            out[f"bias_hh_l{k}"] = L["gc"]["bias_hh"]
        return out


class TorchCharLSTM:
    """The PyTorch side, built and timed in a :class:`ChildProcess` of its own."""

    def __init__(self, weights: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
                 threads: int | None) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.x, self.y = torch.from_numpy(tokens), torch.from_numpy(targets.reshape(-1))
        self.emb = torch.nn.Embedding(VOCAB, EMBED)
        self.lstm = torch.nn.LSTM(EMBED, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.lin = torch.nn.Linear(HIDDEN, VOCAB)
        with torch.no_grad():
            for param, name in self._named_params():
                param.copy_(torch.from_numpy(weights[name]))
        self.params = [*self.emb.parameters(), *self.lstm.parameters(), *self.lin.parameters()]

    def _named_params(self):
        """(parameter, name in :meth:`MinidlCharLSTM.weights`) pairs."""
        yield self.emb.weight, "embed"
        yield self.lin.weight, "lin_w"
        yield self.lin.bias, "lin_b"
        for k in range(LAYERS):
            for name in ("weight_ih", "bias_ih", "weight_hh", "bias_hh"):
                yield getattr(self.lstm, f"{name}_l{k}"), f"{name}_l{k}"

    def describe(self) -> str:
        return f"torch {self.torch.__version__}, {self.torch.get_num_threads()} threads"

    def step(self, tm: Timer) -> float:
        torch = self.torch
        tm.start()
        for p in self.params:
            p.grad = None
        e = self.emb(self.x)
        tm.tick("embedding.fwd")
        out, _ = self.lstm(e)
        tm.tick("lstm.fwd")
        loss = torch.nn.functional.cross_entropy(self.lin(out).reshape(-1, VOCAB), self.y)
        tm.tick("linear+ce.fwd")
        loss.backward()
        tm.tick("backward (all)")
        tm.end()
        return float(loss.detach())

    def step_with_gradients(self) -> tuple[float, dict[str, np.ndarray]]:
        """One step's loss and gradients, named as in :meth:`MinidlCharLSTM.grads`."""
        loss = self.step(Timer())
        return loss, {name: p.grad.numpy().copy() for p, name in self._named_params()}

    def time_steps(self, count: int) -> dict[str, list[float]]:
        return timed_steps(lambda tm: self.step(tm), count)


def timed_steps(step: Callable[[Timer], object], count: int) -> dict[str, list[float]]:
    """Seconds of each of ``count`` steps (``"step"``) and of each part of them."""
    tm = Timer()
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        step(tm)
        times.append(time.perf_counter() - t0)
    return {"step": times, **tm.laps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="blocks per framework")
    ap.add_argument("--block", type=int, default=5,
                    help="counted steps per block (one more runs first, not counted)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads")
    ap.add_argument("--no-torch", action="store_true", help="time minidl alone")
    args = ap.parse_args(argv)
    for name in ("rounds", "block", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (args.batch_size, args.seq_len))
    targets = rng.integers(0, VOCAB, (args.batch_size, args.seq_len))
    model = MinidlCharLSTM(args.batch_size, args.seq_len, rng)
    torch_side = None
    if args.no_torch:
        pass
    elif importlib.util.find_spec("torch") is None:
        print("torch is not installed: minidl alone")
    else:
        torch_side = ChildProcess(TorchCharLSTM, model.weights(), tokens, targets, args.threads)
    try:
        loss_m = model.step(tokens, targets, Timer())
        if torch_side is not None:
            loss_t, gt = torch_side.call("step_with_gradients")
            gm = model.grads()
            err = max(float(np.abs(gm[k] - gt[k]).max() / (np.abs(gt[k]).max() + 1e-30))
                      for k in gt)
            print(f"{torch_side.call('describe')} (in a process of its own); losses "
                  f"{loss_m:.6f} / {loss_t:.6f}; max relative gradient difference {err:.1e}")
        times = alternate(args.rounds, args.block,
                          lambda k: timed_steps(lambda tm: model.step(tokens, targets, tm), k),
                          torch_side, "time_steps", before_round=require_torch_absent)
        require_torch_absent()
    finally:
        if torch_side is not None:
            torch_side.close()
    med = {k: float(np.median(v["step"])) * 1e3 for k, v in times.items()}
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"step (batch {args.batch_size}, seq {args.seq_len}, median of {args.rounds} x "
          f"{args.block} steps in alternating blocks; load average {load}):")
    for k, v in med.items():
        q1, q3 = np.percentile(times[k]["step"], [25, 75]) * 1e3
        print(f"  {k:7s} {v:7.2f} ms   (IQR {q1:.2f}-{q3:.2f})")
    if "torch" in med:
        print(f"  ratio minidl/torch: {med['minidl'] / med['torch']:.2f}x")
    for name, side in times.items():
        parts = {k: float(np.median(v)) * 1e3 for k, v in side.items() if k != "step"}
        print(f"{name} parts (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                        parts.items()))
        if name == "minidl":
            rnn = sum(v for k, v in parts.items() if k.startswith(("proj", "lstm")))
            print(f"  minidl RNN layer calls (proj + lstm, fwd + bwd): {rnn:.2f} ms")


if __name__ == "__main__":
    main()
