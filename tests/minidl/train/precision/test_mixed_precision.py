"""Mixed-precision training on the CPU (issue 46): half tensors in the arena, the dry run's
peak equal to the real run's, PyTorch CPU autocast's numerics, lossless specs bit-identical
to ``none`` within each precision, fp16's dynamic loss scaling and its checkpointed state."""

from __future__ import annotations

import json

import numpy as np
import pytest
from mixed_nets import branches

import minidl
from minidl.memory.ir.precision import Precision
from minidl.net.graph import Input, Network
from minidl.net.optim import SGD
from minidl.train.precision.loss_scaling import DynamicLossScaler
from minidl.zoo.models import lenet5, resnet

MIXED = ["bf16-mixed", "fp16-mixed"]


def _data(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 10, n)


def _mlp():
    x = Input((1, 8, 8))
    h = minidl.layers.Flatten()(x)
    h = minidl.layers.ReLU()(minidl.layers.Linear(64, 32)(h))
    return Network(x, minidl.layers.Linear(32, 10)(h), seed=3)


def _trainer(net, precision, spec="none", lr=0.05):
    return minidl.Trainer(net, SGD(net.parameters(), lr=lr, momentum=0.9), memory=spec,
                          device_memory="64MiB", precision=precision, debug=True)


@pytest.mark.parametrize("precision", MIXED)
def test_feature_maps_are_half_and_dry_run_equals_real_run(precision):
    x, y = _data(8, (1, 8, 8))
    peaks = {}
    for p in ("fp32", precision):
        net = lenet5((1, 8, 8), 10)
        tr = _trainer(net, p, "reuse,inplace")
        tr.step(x, y)
        tr.step(x, y)
        rep = minidl.dry_run(lenet5((1, 8, 8), 10), 8, "reuse,inplace", input_shape=(1, 8, 8),
                             precision=p)
        real = tr.memory_report()
        assert real["peak_allocated_bytes"] == rep["peak_allocated_bytes"], p
        assert real["peak_reserved_bytes"] == rep["peak_reserved_bytes"], p
        peaks[p] = real["peak_allocated_bytes"]
        if p != "fp32":
            prog = tr.last_compiled.plan.program
            half = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[p]
            dtypes = {t.name: str(t.dtype) for t in prog.tensors}
            assert dtypes["conv1"] == half
            conv1 = [st for st in prog.steps if st.layer == "conv1"]  # (forward and backward)
            assert len(conv1) == 2 and all(
                st.forward.param_casts == {"weight": half, "bias": half} for st in conv1)
            assert dtypes["conv1.weight"] == "float32" and dtypes["loss"] == "float32"
            assert all(p.data.dtype == np.float32 and p.grad.dtype == np.float32
                       for p in net.parameters())
    assert peaks[precision] < peaks["fp32"]


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", ["lenet5", "resnet8"])
def test_lossless_specs_bit_identical_to_none_within_the_precision(precision, model):
    make, shape = {"lenet5": (lambda: lenet5((1, 8, 8), 10), (1, 8, 8)),
                   "resnet8": (lambda: resnet(8, (3, 8, 8), 10, width=4), (3, 8, 8))}[model]
    x, y = _data(6, shape)
    runs = {}
    for spec in ("none", "reuse,inplace", "reuse,swap=all", "reuse,recompute=sqrt",
                 "reuse,inplace,static", "reuse,inplace,binarize", "gist"):
        net = make()
        tr = _trainer(net, precision, spec)
        losses = [tr.step(x, y) for _ in range(3)]
        grads = {n: np.array(p.grad) for n, p in net.named_parameters()}
        runs[spec] = losses, grads
        rep = minidl.dry_run(make(), 6, spec, input_shape=shape, precision=precision)
        if spec != "gist":  # (sparse sizes are the data's: a dry run assumes a density)
            assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"], \
                spec
        assert runs[spec][0] == runs["none"][0], spec
        for n, g in runs["none"][1].items():
            assert np.array_equal(grads[n], g), (spec, n)


def _torch_reference(net, x, y, precision):
    torch = pytest.importorskip("torch")
    from minidl.interop.torch_bridge import to_torch

    tm = to_torch(net)
    tm.train()
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    with torch.autocast("cpu", dtype=dtype):
        out = tm(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(out, torch.from_numpy(y))
    loss.backward()
    theirs = dict(tm.named_parameters())
    grads = {}
    for name, _ in net.named_parameters():
        owner, _, local = name.rpartition(".")
        grads[name] = theirs[f"mods.{owner.replace('.', '_')}.{local}"].grad.float().numpy()
    return float(loss.detach()), grads


@pytest.mark.parametrize("precision", MIXED)
@pytest.mark.parametrize("model", ["mlp", "lenet5", "resnet8", "branches"])
def test_loss_and_gradients_match_pytorch_cpu_autocast(precision, model):
    make, shape = {"mlp": (_mlp, (1, 8, 8)), "lenet5": (lambda: lenet5((1, 8, 8), 10), (1, 8, 8)),
                   "resnet8": (lambda: resnet(8, (3, 8, 8), 10, width=4), (3, 8, 8)),
                   "branches": (branches, (3, 8, 8))}[model]
    x, y = _data(6, shape, seed=1)
    net = make()
    ref_loss, ref_grads = _torch_reference(make(), x, y, precision)
    tr = _trainer(net, precision, lr=0.0)
    loss = tr.compute_gradients(x, y)
    eps = {"bf16-mixed": 2.0 ** -8, "fp16-mixed": 2.0 ** -11}[precision]  # unit roundoff
    assert abs(loss - ref_loss) <= 2 * eps * abs(ref_loss)
    for name, g in ref_grads.items():
        # within a few half roundings of the largest gradient of the tensor
        err = np.abs(dict(net.named_parameters())[name].grad - g).max()
        assert err <= 4 * eps * np.abs(g).max() + 1e-7, (name, err)


def test_fp32_keyword_is_bit_identical_to_the_default():
    x, y = _data(6, (1, 8, 8))
    runs = []
    for kw in ({}, {"precision": "fp32"}):
        net = lenet5((1, 8, 8), 10)
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9),
                            device_memory="16MiB", **kw)
        runs.append([tr.step(x, y) for _ in range(3)])
    assert runs[0] == runs[1]


def test_fp16_overflow_skips_the_step_and_backs_off(tmp_path):
    x, y = _data(8, (1, 8, 8))
    net = _mlp()
    tr = _trainer(net, "fp16-mixed")
    scaler = tr.loss_scaler
    assert scaler.scale == 2.0 ** 16 and scaler.growth_interval == 2000
    tr.step(x, y)
    assert scaler.skipped == 0 and scaler.clean_steps == 1
    scaler.scale = 2.0 ** 40  # the loss gradient overflows float16: inf gradients
    before = {n: np.array(v) for n, v in net.state_dict().items()}
    tr.step(x, y)
    assert scaler.skipped == 1 and scaler.scale == 2.0 ** 39 and scaler.clean_steps == 0
    for n, v in net.state_dict().items():  # the update was skipped
        assert np.array_equal(v, before[n]), n
    while scaler.skipped < 30 and scaler.scale > 2.0 ** 20:
        tr.step(x, y)
    assert scaler.scale <= 2.0 ** 20 and np.isfinite(tr.step(x, y))
    # the scaler's state is in the checkpoint: a resumed run continues exactly
    path = tmp_path / "run.npz"
    tr.save(path)
    straight = [tr.step(x, y) for _ in range(2)]
    net2 = _mlp()
    tr2 = _trainer(net2, "fp16-mixed")
    tr2.load(path, resume=True)
    assert tr2.loss_scaler.state_dict() == {**scaler.state_dict(), "clean_steps":
                                            scaler.clean_steps - 2}
    assert [tr2.step(x, y) for _ in range(2)] == straight


def test_scaler_grows_after_clean_steps():
    s = DynamicLossScaler(growth_interval=3)
    for _ in range(3):
        s.update(True)
    assert s.scale == 2.0 ** 17 and s.clean_steps == 0
    s.update(False)
    assert s.scale == 2.0 ** 16 and s.skipped == 1


class _Square(minidl.layers.base.Layer):
    """A user's own layer (kind "generic"): mixed precision has no op policy for it."""

    def forward(self, ctx, inputs, outputs, params, stash, workspace) -> None:
        np.multiply(inputs[0], inputs[0], out=outputs[0])


def test_unsupported_layers_and_devices_are_refused_in_one_line():
    x = Input((1, 8, 8))
    h = _Square()(minidl.layers.ReLU()(x))
    net = Network(x, minidl.layers.Linear(64, 10)(minidl.layers.Flatten()(h)))
    with pytest.raises(ValueError, match="supports Conv2d, Linear.*_Square"):
        minidl.Trainer(net, device_memory="8MiB", precision="bf16-mixed")
    with pytest.raises(ValueError, match="GPU setting"):
        minidl.Trainer(_mlp(), device_memory="8MiB", precision="tf32")


@pytest.mark.parametrize("precision", MIXED)
def test_batch_norm_running_statistics_are_updated_in_float32(precision):
    """Batch norm's running statistics are float32 buffers updated in place (no half copy of
    them: an update written into a copy was lost, and evaluation then normalised with the
    initial statistics); after the same steps (weights left unchanged) they and the evaluation
    loss are those of fp32 within half rounding of the inputs."""
    x, y = _data(16, (3, 8, 8), seed=2)
    runs = {}
    for p in ("fp32", precision):
        net = resnet(8, (3, 8, 8), 10, width=4)
        tr = _trainer(net, p, spec="reuse,inplace", lr=0.0)
        for _ in range(3):
            tr.step(x, y)
        stats = [np.array(b.data, copy=True) for b in net.buffers()
                 if b.data.dtype == np.float32]
        runs[p] = (stats, tr.evaluate(x, y)[0])
    ref, got = runs["fp32"], runs[precision]
    assert len(ref[0]) == len(got[0]) > 0
    for a, b in zip(ref[0], got[0]):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=0.05, atol=0.02)
    assert abs(got[1] - ref[1]) <= 0.05 * abs(ref[1]) + 0.01


@pytest.mark.parametrize("precision", MIXED)
def test_reduced_precision_codes_only_narrower_than_the_half_maps(precision):
    """``dpr=fp8`` keeps the half feature maps in fp8 (exact values cast up to encode, decoded
    exactly back); ``dpr=fp16`` / ``bf16`` would save nothing on them and encode none; dry
    run == real run."""
    x, y = _data(6, (3, 8, 8))
    encoded = {}
    for spec in ("reuse,inplace", "reuse,dpr=fp16", "reuse,dpr=fp8"):
        net = resnet(8, (3, 8, 8), 10, width=4)
        tr = _trainer(net, precision, spec)
        losses = [tr.step(x, y) for _ in range(3)]
        rep = minidl.dry_run(resnet(8, (3, 8, 8), 10, width=4), 6, spec, input_shape=(3, 8, 8),
                             precision=precision)
        assert tr.memory_report()["peak_allocated_bytes"] == rep["peak_allocated_bytes"], spec
        summary = tr.last_compiled.plan.program.rewrites.compression
        encoded[spec] = (len(summary.encoded) if summary else 0, losses,
                         rep["peak_allocated_bytes"])
    assert encoded["reuse,dpr=fp16"][0] == 0
    assert encoded["reuse,dpr=fp16"][1] == encoded["reuse,inplace"][1]
    assert encoded["reuse,dpr=fp8"][0] > 0
    assert encoded["reuse,dpr=fp8"][2] < encoded["reuse,dpr=fp16"][2]
    assert np.isfinite(encoded["reuse,dpr=fp8"][1]).all()


TRAIN = ["train", "smallcnn", "--dataset", "synthetic", "--input", "1x8x8", "--width", "4",
         "--max-steps", "2", "--no-progress"]


@pytest.mark.parametrize("precision", ["fp32", *MIXED])
def test_cli_train_reports_the_precision_in_text_and_json(capsys, precision):
    from minidl.cli import main

    assert main([*TRAIN, "--precision", precision]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("precision: ")]
    want = {"fp32": "precision: fp32",
            "bf16-mixed": "precision: bf16-mixed (bfloat16 compute, float32 master weights)",
            "fp16-mixed": "precision: fp16-mixed (float16 compute, float32 master weights), "
                          "final loss scale 65536, 0 steps skipped (inf/NaN gradients)"}
    assert lines == [want[precision]]
    assert main([*TRAIN, "--precision", precision, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == precision
    assert ("loss_scale" in out) == (precision == "fp16-mixed")
    if precision == "fp16-mixed":
        assert out["loss_scale"] == 2.0 ** 16 and out["skipped_steps"] == 0


def test_precision_line_carries_the_scalers_skips_and_backed_off_scale(capsys):
    from minidl.commands.train_report import precision_entries, print_precision

    tr = _trainer(_mlp(), "fp16-mixed")
    tr.loss_scaler.update(False)
    entries = precision_entries(tr)
    assert entries == {"precision": "fp16-mixed", "loss_scale": 2.0 ** 15, "skipped_steps": 1}
    print_precision(entries)
    assert capsys.readouterr().out == ("precision: fp16-mixed (float16 compute, float32 master "
                                       "weights), final loss scale 32768, 1 step skipped "
                                       "(inf/NaN gradients)\n")


@pytest.mark.parametrize("precision", MIXED)
def test_inference_plan_in_mixed_precision_is_below_fp32_and_the_real_runs_peak(capsys,
                                                                                precision):
    from minidl.cli import main
    from minidl.compile.engine import Engine
    from minidl.memory.devices.device import CpuDevice
    from minidl.memory.runtime.pool import Pool

    plan = ["plan", "resnet20", "--input", "3x16x16", "--classes", "10", "--batch-size", "8"]
    reps = {}
    for p in ("fp32", precision):
        assert main([*plan, "--eval", "--precision", p, "--json"]) == 0
        reps[p] = json.loads(capsys.readouterr().out)
    assert reps[precision]["peak_allocated_bytes"] < reps["fp32"]["peak_allocated_bytes"]
    pool = Pool(CpuDevice("64MiB"))
    engine = Engine(resnet(20, (3, 16, 16), 10), pool, "reuse,inplace",
                    precision=precision)
    x, _ = _data(8, (3, 16, 16))
    c = engine.compiled([x.shape], None, training=False)
    _, outs = c.executor.run([x, None], training=False, fetch_outputs=True)
    assert str(outs[0].dtype) == Precision.of(precision).half_dtype  # (the head computed in half)
    stats = pool.stats()
    assert stats["allocated_bytes.peak"] == reps[precision]["peak_allocated_bytes"]
    assert stats["reserved_bytes.peak"] == reps[precision]["peak_reserved_bytes"]
    assert main([*plan, "--inference", "--precision", precision]) == 0
    assert f"precision {precision}: at the peak " in capsys.readouterr().out
