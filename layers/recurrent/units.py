"""Shared machinery of the fused recurrent layers (:mod:`minidl.layers.recurrent`): one
unit's projection and recurrence, its weight, bias and input gradients, the token table."""

from __future__ import annotations

import numpy as np

from ...kernels.blas import gemm
from ...kernels.transformer.embedding import embedding_accumulate, take_rows
from ..transformer.embedding import check_index_range


def _flat(buf: np.ndarray, *shape: int) -> np.ndarray:
    """The first prod(shape) elements of the contiguous ``buf`` as a C-contiguous array."""
    return buf.reshape(-1)[:int(np.prod(shape))].reshape(shape)


class _Accumulator:
    """Writes the first value of each gradient, adds the later ones (in call order); adds
    every value into the gradients named in ``adds`` (``ctx.accumulate``: micro-batches)."""

    def __init__(self, grad_params: dict, adds: frozenset[str] = frozenset()) -> None:
        self.grad_params = grad_params
        self.first = set(grad_params) - set(adds)

    def __call__(self, name: str, value: np.ndarray) -> None:
        if name not in self.grad_params:
            return
        if name in self.first:
            np.copyto(self.grad_params[name], value)
            self.first.discard(name)
        else:
            self.grad_params[name] += value


class _UnitOps:
    """Unit-level operations of :class:`~minidl.layers.recurrent.fused._Recurrent` (a mixin: it
    uses the layer's sizes and its cell hooks ``_step_forward`` / ``_prepare_bias``)."""

    def _internals(self, source):
        """(gates, hs, cs): the layers' time-major internals by name (``gates``, ``h``,
        ``c``), from the stash (everything kept) or the unit's workspace buffers
        (scheduled); ``cs`` is None for a GRU."""
        return source["gates"], source["h"], (source["c"] if self.state_parts == 2 else None)

    def _parts(self, hs, cs):
        return [hs] if cs is None else [hs, cs]

    def _run_unit(self, params, x, u0, u1, gates, hs, cs, xs, gx, hw, bias, table) -> None:
        """Forward of steps u0..u1-1 for every layer into one unit's internals: index 0 of
        ``hs`` / ``cs`` holds the state at boundary u0 on entry; step u0+s writes gates[s]
        and states[s+1]."""
        for k in range(self.num_layers):
            self._project(k, params, x, u0, u1, 0, hs, xs, gx, bias, table)
            for s in range(u1 - u0):
                self._step_forward(k, s, s, params, gates, hs, cs, gx, hw, bias)
                self._round_step(k, s, gates, hs, cs)

    #: The dtype each step's gates and states are rounded to as written (``None``: kept as
    #: computed); set from ``ctx.storage_dtype`` at each forward and backward.
    _round_to = None

    def _round_step(self, k, i, gates, hs, cs) -> None:
        """Round layer k's gates and new states of step i to :attr:`_round_to` in place."""
        if self._round_to is None:
            return
        for a in (gates[k, i], hs[k, i + 1], *(() if cs is None else (cs[k, i + 1],))):
            a[...] = a.astype(self._round_to)

    #: Steps per input-projection product: a unit's projection is computed in pieces of
    #: this many steps, each its own product, in every path (keeping everything or
    #: scheduled: the same products, the same bits), so the pipelined lanes can start a
    #: layer's recurrence on the first piece while the layer below is still in the unit
    #: (half the pipeline's fill and drain with 16-step units). Measured against whole-unit
    #: projections (two trainers alternating in one process): char-lstm b32 seq64 0.969x,
    #: char-gru 0.972x the step time; pieces of 4 steps even with 8.
    projection_steps = 8
    #: ... except the sequence's first and last piece, of this many steps: the lanes'
    #: pipeline fills while the first piece's recurrence runs alone (forward) and drains
    #: while the last one's does (and backward the reverse), so shorter edge pieces leave a
    #: lane idle for less time.
    edge_projection_steps = 4

    def _pieces(self, u0: int, u1: int, t: int) -> list[tuple[int, int]]:
        """(start, stop) local steps of the projection pieces of the unit of steps
        ``u0..u1-1`` of a ``t``-step sequence (:data:`projection_steps`,
        :data:`edge_projection_steps`)."""
        p, e, m = max(1, self.projection_steps), max(1, self.edge_projection_steps), u1 - u0
        out = [(a, min(a + p, m)) for a in range(0, m, p)]
        if out and u0 == 0 and out[0][1] - out[0][0] > e:
            out[:1] = [(0, e), (e, out[0][1])]
        if out and u1 == t and out[-1][1] - out[-1][0] > e:
            a, b = out[-1]
            out[-1:] = [(a, b - e), (b - e, b)]
        return out

    def _project(self, k, params, x, u0, u1, lo, hs, xs, gx, bias, table,
                 pieces: list[tuple[int, int]] | None = None) -> None:
        """Layer k's input projection of steps u0..u1-1 into ``gx`` (and its ``bias``), piece
        by piece (:meth:`_pieces`; ``pieces``: only those)."""
        n = x.shape[0]
        for a, b in pieces if pieces is not None else self._pieces(u0, u1, x.shape[1]):
            m = b - a
            g = gx[a:b]
            g2 = g.reshape(m * n, -1)
            if k == 0 and table.size:  # gather the rows of embedding @ weight_ih_l0.T
                take_rows(table, x[:, u0 + a:u0 + b].T, g)
            else:
                if k == 0:
                    self._layer_input(params, x, u0 + a, u0 + b, xs)
                    xin = xs[:m].reshape(m * n, self.input_size)
                else:
                    xin = hs[k - 1, lo + 1 + a:lo + 1 + b].reshape(m * n, self.hidden_size)
                np.matmul(xin, params[f"weight_ih_l{k}"].T, out=g2)
            self._prepare_bias(params, k, g2, bias)

    def _grad_into_lower(self, k, params, dg, low, pieces) -> None:
        """The gradient into layer k-1's outputs of a unit's steps, ``low = dG @ W_ih``
        (time-major ``(m, n, G)`` -> ``(m, n, H)``), one product per projection piece (the
        same products in every path)."""
        w = params[f"weight_ih_l{k}"]
        for a, b in pieces:
            rows = (b - a) * dg.shape[1]
            np.matmul(dg[a:b].reshape(rows, -1), w, out=low[a:b].reshape(rows, -1))

    def _layer_input(self, params, x, u0, u1, xs) -> None:
        """Steps u0..u1-1 of the first layer's input, time-major, into ``xs``."""
        if self.vocab_size is not None:
            take_rows(params["embedding"], x[:, u0:u1].T, xs[:u1 - u0])
        else:
            np.copyto(xs[:u1 - u0], x[:, u0:u1].transpose(1, 0, 2))

    def _check_tokens(self, x) -> None:
        if self.vocab_size is not None:
            check_index_range(self, x, self.vocab_size, "token")

    def check_feed(self, index, host, in_shapes) -> None:
        if index == 0:
            self._check_tokens(host)

    def _make_table(self, params, table) -> None:
        if table.size:
            np.matmul(params["embedding"], params["weight_ih_l0"].T, out=table)

    def _load_initial(self, inputs, hs, cs, index: int) -> None:
        for p, arr in enumerate(self._parts(hs, cs)):
            if self.initial_state:
                np.copyto(arr[:, index], inputs[1 + p])
            else:
                arr[:, index].fill(0)

    def _grad_w_hh(self, k, dgh2, hprev, prod, accumulate) -> None:
        """Add one unit's ``dG_hh^T h_prev`` to layer k's ``weight_hh`` gradient."""
        dw = _flat(prod, self.gates, self.hidden_size)
        np.matmul(dgh2.T, hprev.reshape(dgh2.shape[0], self.hidden_size), out=dw)
        accumulate(f"weight_hh_l{k}", dw)

    def _grad_w_ih_and_biases(self, k, params, x, u0, u1, lo, hs, dg2, dgh2, prod, colsum, xs,
                              token_dg, accumulate) -> None:
        """Add steps u0..u1-1 (local index ``lo``) to layer k's ``weight_ih`` gradient (for
        tokens through the table: dG summed per token) and bias gradients."""
        m, rows = u1 - u0, dg2.shape[0]
        if k == 0 and token_dg.size:
            embedding_accumulate(x[:, u0:u1].T.reshape(-1), dg2, token_dg)
        else:
            if k == 0:
                self._layer_input(params, x, u0, u1, xs)
                xin = xs[:m].reshape(rows, self.input_size)
            else:
                xin = hs[k - 1, lo + 1:lo + 1 + m].reshape(rows, self.hidden_size)
            dw = _flat(prod, self.gates, xin.shape[1])
            np.matmul(dg2.T, xin, out=dw)
            accumulate(f"weight_ih_l{k}", dw)
        if self.bias:
            np.sum(dg2, axis=0, out=colsum)
            accumulate(f"bias_ih_l{k}", colsum)
            if self.gate_factor == 3:  # GRU: b_hh gets the recurrent gradient
                np.sum(dgh2, axis=0, out=colsum)
            accumulate(f"bias_hh_l{k}", colsum)

    def _input_gradient(self, params, x, grad_inputs, grad_params, u0, u1, dg2, dxbuf,
                        token_dg) -> None:
        """Layer 0's input gradient of steps u0..u1-1 from its dG rows: into ``grad x``, or
        (tokens without the table) scatter-added into the embedding's gradient."""
        n, I = x.shape[0], self.input_size
        m, rows = u1 - u0, (u1 - u0) * x.shape[0]
        if self.vocab_size is not None:
            if not token_dg.size and "embedding" in grad_params:
                d = _flat(dxbuf, rows, I)
                np.matmul(dg2, params["weight_ih_l0"], out=d)
                embedding_accumulate(x[:, u0:u1].T.reshape(-1), d, grad_params["embedding"])
        elif grad_inputs[0] is not None:
            d = _flat(dxbuf, rows, I)
            np.matmul(dg2, params["weight_ih_l0"], out=d)
            np.copyto(grad_inputs[0][:, u0:u1], d.reshape(m, n, I).transpose(1, 0, 2))

    def _finish_tokens(self, params, grad_params, token_dg, adds: frozenset[str]) -> None:
        """dW_ih0 = S^T E and d embedding = S W_ih0, S being dG summed per token (table);
        added into the gradients named in ``adds``."""
        if not token_dg.size:
            return
        for name, a, b, trans_a in (("weight_ih_l0", token_dg, params["embedding"], True),
                                    ("embedding", token_dg, params["weight_ih_l0"], False)):
            if name not in grad_params:
                continue
            if name in adds:
                gemm(a, b, grad_params[name], trans_a=trans_a, beta=1.0)
            else:
                np.matmul(a.T if trans_a else a, b, out=grad_params[name])
