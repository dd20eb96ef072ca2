"""The transformer models through the engine: every memory strategy on a tiny GPT (and the
post-LN BERT) bit-identical to ``none`` where lossless, dry-run peak == real peak, the block
outputs as recomputation checkpoints, and the CLI's plan and train commands."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import minidl
from minidl.cli import main
from minidl.memory.passes.recompute import articulation_values
from minidl.net.optim import AdamW
from minidl.zoo.transformers import TransformerConfig, bert, gpt, transformer

TINY = TransformerConfig(layers=2, heads=2, dim=32, context=8, vocab=11, dropout=0.1)
LOSSLESS = [
    "reuse", "inplace", "reuse,inplace", "static", "reuse,inplace,static",
    "reuse,swap=all", "reuse,swap=auto", "reuse,inplace,swap=all,static",
    "reuse,recompute=sqrt", "reuse,recompute=speed", "reuse,recompute=memory",
    "reuse,recompute=cost", "reuse,inplace,recompute=cost,swap=all,static",
]


def _tiny_gpt(config: TransformerConfig = TINY):
    return gpt(config, name="tiny-gpt")


def _tiny_bert():
    return bert(TINY, name="tiny-bert")


def _batch(n=3, config: TransformerConfig = TINY, seed=0):
    rng = np.random.default_rng(seed)
    shape = (n, config.context)
    return rng.integers(0, config.vocab, shape), rng.integers(0, config.vocab, shape)


def _train(make, x, y, spec, steps=2, device_memory="32MiB"):
    net = make()
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-2), memory=spec,
                        device_memory=device_memory, debug=True)
    losses = [tr.step(x, y) for _ in range(steps)]
    grads = {n: np.array(p.grad) for n, p in net.named_parameters()}
    return losses, grads, tr


def _assert_identical(run, ref, spec):
    assert run[0] == ref[0], f"{spec}: losses differ: {run[0]} vs {ref[0]}"
    for n, g in ref[1].items():
        assert np.array_equal(run[1][n], g), f"{spec}: gradient of {n} differs"


@pytest.mark.parametrize("make", [_tiny_gpt, _tiny_bert], ids=["gpt", "bert"])
def test_lossless_strategies_bit_identical_and_dry_run_exact(make):
    x, y = _batch()
    ref = _train(make, x, y, "none")
    peaks = {"none": ref[2].memory_report()["peak_allocated_bytes"]}
    specs = LOSSLESS if make is _tiny_gpt else LOSSLESS[2::3]
    for spec in specs:
        run = _train(make, x, y, spec)
        _assert_identical(run, ref, spec)
        real = run[2].memory_report()
        dry = minidl.dry_run(make(), 3, spec, "adamw")
        assert dry["peak_allocated_bytes"] == real["peak_allocated_bytes"], spec
        assert dry["peak_reserved_bytes"] == real["peak_reserved_bytes"], spec
        peaks[spec] = real["peak_allocated_bytes"]
    assert peaks["reuse,inplace"] < peaks["none"]


def test_recompute_sqrt_keeps_transformer_blocks_as_checkpoints():
    """The articulation points of a GPT's forward graph (recompute=sqrt's candidates) are
    the residual stream between half-blocks (each block's two residual adds), the embeddings
    and the final LayerNorm / head: never a value inside an attention or MLP branch."""
    net = gpt(TransformerConfig(layers=4, heads=2, dim=16, context=4, vocab=7))
    tr = minidl.Trainer(net, memory="reuse,recompute=sqrt", device_memory="16MiB")
    x, y = _batch(2, TransformerConfig(layers=4, heads=2, dim=16, context=4, vocab=7))
    tr.step(x, y)
    program = tr.engine.compiled([x.shape], y.shape, True).lowered.program
    makers = {t: s for s in program.steps if s.phase == "forward" for t in s.access.writes}
    names = [program.tensors[t].name for t in articulation_values(program)]
    blocks = [n for n in names if ".h." in n]
    assert blocks == [f"transformer.h.{i}.add_{k}" for i in range(4) for k in (1, 2)], names
    assert all(makers[t].phase == "forward" for t in articulation_values(program))


def test_auto_with_a_budget_fits_and_stays_bit_identical():
    x, y = _batch(4)
    lean = minidl.dry_run(_tiny_gpt(), 4, "reuse,inplace", "adamw")
    budget = int(0.97 * lean["peak_allocated_bytes"])
    plan = minidl.dry_run(_tiny_gpt(), 4, f"auto,budget={budget}", "adamw")
    assert plan["peak_reserved_bytes"] <= budget and plan["split"] == 1
    ref = _train(_tiny_gpt, x, y, "none")
    run = _train(_tiny_gpt, x, y, f"auto,budget={budget}")
    _assert_identical(run, ref, "auto")
    assert run[2].memory_report()["peak_reserved_bytes"] <= budget


def test_split_and_reduced_precision_stay_close():
    """Without dropout (micro-batches draw their own masks) split=2 gives the batch's
    gradients up to summation order; dpr=fp16 stays close."""
    x, y = _batch(4)

    def make():
        return _tiny_gpt(replace(TINY, dropout=0.0))

    ref = _train(make, x, y, "none")
    split = _train(make, x, y, "reuse,split=2")
    np.testing.assert_allclose(split[0], ref[0], rtol=1e-5)
    for n, g in ref[1].items():
        np.testing.assert_allclose(split[1][n], g, rtol=1e-3, atol=1e-6, err_msg=n)
    half = _train(make, x, y, "reuse,inplace,dpr=fp16")
    np.testing.assert_allclose(half[0], ref[0], rtol=2e-3)


def test_sizes_follow_the_sequence_length_and_the_papers():
    small = transformer("gpt2-small", seq_len=16)
    assert small.num_parameters() == 124_439_808 - (1024 - 16) * 768  # GPT-2 124M
    assert dict(small.named_parameters())["transformer.wpe.weight"].shape == (16, 768)
    names = [n for n, _ in small.named_parameters()]
    assert "lm_head.weight" not in names  # tied to transformer.wte.weight
    char = transformer("gpt-char", vocab=65)
    assert char.input_shapes[0] == (256,) and char.vocab_size == 65
    with pytest.raises(ValueError, match="multiple of the 6 heads"):
        transformer("gpt-char", width=100)


def test_cli_plans_and_trains_the_transformers(capsys, tmp_path):
    assert main(["plan", "bert-base", "--seq-len", "128", "--batch-size", "2", "--width", "48",
                 "--memory", "none", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["input"] == [128] and rep["model"] == "bert-base"
    assert main(["plan", "gpt-char", "--batch-size", "2", "--seq-len", "32", "--width", "48",
                 "--memory", "reuse,inplace,recompute=sqrt"]) == 0
    assert "gpt-char, batch 2, input 32" in capsys.readouterr().out
    assert main(["train", "gpt-char", "--dataset", "synthetic", "--seq-len", "16", "--width",
                 "24", "--batch-size", "4", "--max-steps", "3", "--no-progress", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 3 and np.isfinite(out["val_loss"])
    assert main(["plan", "gpt-char", "--seq-len", "0"]) == 2
    assert "--seq-len must be >= 1" in capsys.readouterr().err
    assert main(["plan", "gpt-char", "--width", "100"]) == 2
    assert "width 100 is not a multiple of the 6 heads" in capsys.readouterr().err


def test_bert_base_at_full_size_plans_on_the_meta_device(capsys):
    """The issue's command at full size: 109.5 M parameters; the largest tensor is the
    masked-LM logits of 64 x 512 positions over 30522 words (no array of it is ever made)."""
    assert main(["plan", "bert-base", "--seq-len", "512", "--batch-size", "64", "--memory",
                 "none", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    params = transformer("bert-base", seq_len=8).num_parameters() + (512 - 8) * 768
    assert rep["breakdown"]["parameter"] == pytest.approx(4 * params, rel=1e-3)
    assert rep["largest_tensor_bytes"] == 64 * 512 * 30522 * 4
    assert rep["peak_reserved_bytes"] > 2 * 64 * 512 * 30522 * 4
