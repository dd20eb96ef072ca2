"""A small GPT and BERT on the strict CUDA device (the transformer layers' device kernels end
to end): bounded launches per layer call, no host synchronisation in a step that does not wait,
no temporaries (the scratch block stays empty), loss and gradients equal to the CPU run's
within 1e-5 (both attention forms)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from transformer_cases import _heads, _normal, close

from minidl.kernels import blas
from minidl.kernels.transformer import attention as AK

# ----------------------------------------------------------------------------- strict device
#: Most launches one call of a layer makes on the strict device (its kernels, its GEMMs and
#: what the executor adds, e.g. a gradient added into a residual's): attention's two
#: projections are 2 forward and 3 backward each, its core 4 forward and 7 backward (keep form,
#: dropout on); blockwise attention is bounded per tile.
LAUNCHES = {("LayerNorm", "forward"): 1, ("LayerNorm", "backward"): 4,
            ("MultiHeadAttention", "forward"): 8, ("MultiHeadAttention", "backward"): 14,
            ("Dropout", "forward"): 1, ("Dropout", "backward"): 1,
            ("Embedding", "forward"): 1, ("Embedding", "backward"): 1,
            ("PositionalEmbedding", "forward"): 1, ("PositionalEmbedding", "backward"): 2}


def _tiny(model: str):
    from minidl.zoo.transformers import TransformerConfig, bert, gpt

    config = TransformerConfig(layers=2, heads=2, dim=16, context=20, vocab=13, dropout=0.1)
    return (gpt if model == "gpt" else bert)(config, name=f"tiny-{model}")


def _attention_launches(form: str | None, seq: int) -> tuple[int, int]:
    """Bounds of one attention call's launches: 8 / 14 kept; blockwise (causal, with dropout)
    4 per tile and 1 per row block forward, 8 per tile and 2 backward, plus the projections
    (and an add into a residual's gradient)."""
    if form is None:
        return LAUNCHES[("MultiHeadAttention", "forward")], \
            LAUNCHES[("MultiHeadAttention", "backward")]
    n = AK.parse_form(form)
    tiles = sum(1 for _ in AK._tiles(seq, min(n, seq), True))
    blocks = -(-seq // n)
    return 4 + 4 * tiles + blocks, 7 + 2 + 8 * tiles


@pytest.mark.parametrize("model,form", [("gpt", None), ("gpt", "blockwise:5"),
                                        ("bert", None)])
def test_transformer_steps_on_the_strict_device(model, form, monkeypatch):
    """Bounded launches per layer call, no host synchronisation in a step that does not
    wait, no temporaries (the scratch block for CuPy's temporaries stays empty or a few KiB),
    the CPU's loss and gradients within 1e-5."""
    pytest.importorskip("cupy")
    import minidl
    import minidl.memory.options.attention_options as A
    from minidl.compile.executor import Executor
    from minidl.memory.runtime.transfer import to_host
    from minidl.memory.testing.strict_device import StrictCudaDevice
    from minidl.net.optim import AdamW

    if form is not None:
        monkeypatch.setattr(A, "policies", lambda program, config: [form])
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 13, (3, 20)), rng.integers(0, 13, (3, 20))
    runs = {}
    for name, dev in (("cpu", "cpu"), ("gpu", StrictCudaDevice("64MiB"))):
        net = _tiny(model)
        tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-3), memory="reuse,inplace",
                            device=dev, device_memory="64MiB")
        loss = tr.step(x, y)
        runs[name] = (loss, {k: to_host(p.grad) for k, p in net.named_parameters()}, tr, dev)
    (loss_c, grads_c, _, _), (loss_g, grads_g, tr, dev) = runs["cpu"], runs["gpu"]
    assert loss_g == pytest.approx(loss_c, rel=1e-5)
    for k, g in grads_c.items():
        err = np.max(np.abs(grads_g[k] - g)) / max(np.max(np.abs(g)), 1e-30)
        assert err <= 1e-5, (k, err)
    tr.step(x, y)  # (the scratch block is sized by the first steps)
    counts: Counter = Counter()

    def counting(run):
        def counted(self, st, rt, *args):
            before = dev.launches
            run(self, st, rt, *args)
            key = (type(self.layers[st.node]).__name__, st.phase)
            counts[key] = max(counts[key], dev.launches - before)
        return counted

    for name in ("_forward", "_backward"):
        monkeypatch.setattr(Executor, name, counting(getattr(Executor, name)))
    syncs = dev.host_syncs
    tr.step(x, y, wait=False)
    assert dev.host_syncs == syncs, f"{dev.host_syncs - syncs} host synchronisations"
    bounds = dict(LAUNCHES)
    fwd, bwd = _attention_launches(form, 20)
    bounds[("MultiHeadAttention", "forward")] = fwd
    bounds[("MultiHeadAttention", "backward")] = bwd
    for key, bound in bounds.items():
        assert counts[key] <= bound, (key, counts[key], bound)
    assert counts[("LayerNorm", "forward")] == 1 and counts[("MultiHeadAttention", "forward")]
    assert tr.engine.scratch is None or tr.engine.scratch.size <= 4 << 10, tr.engine.scratch


def test_batched_gemm_on_the_strict_device_writes_into_c():
    """Contiguous operands go to CuPy's batched matmul, head views to the strided kernel:
    one launch each, no temporary (what CuPy's matmul would copy)."""
    pytest.importorskip("cupy")
    from minidl.memory.testing.strict_device import StrictCudaDevice

    dev = StrictCudaDevice("8MiB")
    rng = np.random.default_rng(1)
    qkv, p = _normal(rng, 2, 9, 3 * 8), _normal(rng, 2, 2, 9, 9)
    offsets = iter(range(0, 1 << 20, 1 << 14))  # arena views, as the engine's arrays

    def put(a):
        d = dev.view(next(offsets), a.nbytes, a.shape, a.dtype)
        d.set(a)
        return d

    dq, dp, dc, dout = map(put, (qkv, p, np.zeros_like(p), np.zeros((2, 2, 9, 4), np.float32)))
    made = []
    dev._new_buffer = lambda nbytes, new=dev._new_buffer: made.append(nbytes) or new(nbytes)
    before = dev.launches
    blas.batched_gemm(dp, dp, dc)  # contiguous: matmul
    blas.batched_gemm(dp, dq.reshape(2, 9, 3, 2, 4).transpose(2, 0, 3, 1, 4)[2], dout)
    assert dev.launches - before == 2 and not made, made
    close(dc.get(), p @ p, scale=10)
    close(dout.get(), p @ _heads(qkv, 2, 3)[2], scale=10)
