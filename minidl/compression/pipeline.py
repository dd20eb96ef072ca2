"""Deep Compression end to end (Han, Mao and Dally, ICLR 2016): prune with retraining, share
weights and fine-tune the shared values, Huffman-code, write the file, and measure the
accuracy after every stage (the last one from the file itself, through the inference path).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..analysis.dryrun import auto_device_memory
from ..datasets.data import Dataset, random_shift
from ..kernels.compression import weight_record
from ..memory.runtime.transfer import to_host
from ..net.graph import Network
from ..net.optim import Optimizer, make_optimizer
from ..net.parameter import Parameter
from ..train.trainer import Trainer
from . import container, report
from .container import CompressedModel
from .inference import CompressedRunner
from .layer_spec import bit_width, compressible_weights, fraction, parse_setting
from .pruning import MaskedOptimizer, magnitude_mask, schedule
from .quantization import ClusterOptimizer, SharedWeights, share_weights


@dataclass
class Retraining:
    """How a pruned or weight-shared network retrains: ``steps`` steps of ``batch_size``
    images, each moved by one pixel with ``shift_probability``
    (:func:`~minidl.datasets.data.random_shift`: a network that fits its train split exactly
    gets no gradient from it), under the training memory spec ``memory``, seeded by ``seed``."""

    steps: int = 300
    batch_size: int = 64
    shift_probability: float = 0.0
    memory: str = "reuse,inplace"
    seed: int = 0


@dataclass
class RetrainOptimizer:
    """The retraining optimizer ``name`` at ``lr`` (default: a tenth of ``minidl train``'s
    default) with ``weight_decay``; fine-tuning the shared values uses ``finetune_lr`` (default
    ``lr / 10``: a centroid's gradient is the sum over its cluster, so it grows with the
    cluster)."""

    name: str = "sgd"
    lr: float | None = None
    finetune_lr: float | None = None
    weight_decay: float = 0.0


@dataclass
class CompressionSettings:
    """What :func:`deep_compress` does.

    ``prune``: fraction of each layer's weights removed (``0.9``, or per kind / layer:
    ``conv=0.6,fc=0.92,conv1=0.3``), reached over ``rounds`` rounds of pruning, each followed
    by retraining (:class:`Retraining`) with the survivors masked. ``bits``: bits of the
    shared-value codes per layer (``conv=8,fc=5``: 255 and 31 shared values, code 0 is zero);
    the shared values are then fine-tuned for as many steps. ``index_bits``: bits of a
    relative index (the paper's 8 for convolutions and 5 for fully connected layers). The test
    accuracy is measured in batches of ``eval_batch_size``.
    """

    prune: str = "0.9"
    bits: str = "conv=8,fc=5"
    index_bits: str = "conv=8,fc=5"
    rounds: int = 3
    retraining: Retraining = field(default_factory=Retraining)
    optimizer: RetrainOptimizer = field(default_factory=RetrainOptimizer)
    eval_batch_size: int = 256
    #: Measure the test accuracy after every pruning round (not only the last).
    evaluate_rounds: bool = False

    def check(self, net: Network) -> None:
        """Raise ``ValueError`` (one line) for a bad setting."""
        weights = compressible_weights(net)
        layers = [c.layer for c in weights]
        for flag, text, convert, valid in (
                ("--prune", self.prune, fraction, "a fraction in [0, 1)"),
                ("--bits", self.bits, bit_width, "an integer in [1, 12]"),
                ("--index-bits", self.index_bits, bit_width, "an integer in [1, 12]")):
            setting = parse_setting(text, flag, convert, valid, layers)
            missing = [c.layer for c in weights if setting.for_layer(c.layer, c.kind) is None]
            if missing:
                raise ValueError(f"{flag} {text!r} gives no value for {', '.join(missing)}: "
                                 f"add a default (a bare value) or KIND=VALUE for conv and fc")
        r = self.retraining
        if self.rounds < 1 or r.steps < 0 or r.batch_size < 1:
            raise ValueError(f"rounds and batch_size must be >= 1 and retrain_steps >= 0, got "
                             f"{self.rounds}, {r.batch_size} and {r.steps}")
        make_optimizer(self.optimizer.name, [], self.optimizer.lr)


@dataclass
class CompressionResult:
    """The compressed model, its per-layer report and the accuracy after each stage."""

    model: CompressedModel
    rows: list[report.LayerRow]
    accuracy: dict[str, float | None] = field(default_factory=dict)
    file_bytes: int = 0
    predictions_match: bool | None = None  # the file's predictions == the decompressed net's

    @property
    def dense_bytes(self) -> int:
        return sum(r.sizes.dense for r in self.rows)

    @property
    def ratio(self) -> float:
        """Dense float32 bytes over the file's bytes."""
        return self.dense_bytes / max(self.file_bytes, 1)

    def table(self) -> str:
        return report.format_table(self.rows, self.accuracy, self.file_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model.model, "file_bytes": self.file_bytes,
                "dense_bytes": self.dense_bytes, "ratio": self.ratio,
                "stage_bytes": report.totals(self.rows), "accuracy": self.accuracy,
                "predictions_match": self.predictions_match,
                "layers": report.rows_as_dicts(self.rows)}


class _Stages:
    """The trainers of the stages (one per optimizer) on one dataset."""

    def __init__(self, net: Network, ds: Dataset, s: CompressionSettings,
                 progress: bool) -> None:
        self.net, self.ds, self.s, self.progress = net, ds, s, progress
        self.device_memory = auto_device_memory(net, s.retraining.batch_size,
                                                s.retraining.memory, "adam", ds.input_shape)

    def lr(self, finetune: bool = False) -> float:
        o = self.s.optimizer
        lr = o.lr if o.lr is not None else 0.005 if o.name == "sgd" else 1e-4
        if not finetune:
            return lr
        return o.finetune_lr if o.finetune_lr is not None else lr / 10

    def optimizer(self, params: list[Parameter], finetune: bool = False) -> Optimizer:
        return make_optimizer(self.s.optimizer.name, params, self.lr(finetune),
                              self.s.optimizer.weight_decay)

    def trainer(self, optimizer: Any) -> Trainer:
        return Trainer(self.net, optimizer, memory=self.s.retraining.memory,
                       device_memory=self.device_memory, seed=self.s.retraining.seed)

    def accuracy(self, trainer: Trainer) -> float:
        return trainer.evaluate(self.ds.x_test, self.ds.y_test, self.s.eval_batch_size)[1]

    def train(self, trainer: Trainer, steps: int) -> None:
        """``steps`` steps of ``trainer``: the whole epochs in one ``fit`` (its lines count
        them: epoch 1/7 ... 7/7), then the last, partial epoch's steps in a second one that
        continues where the first stopped (the same batches and augmentation as one call;
        it prints no epoch line, as an epoch cut short never did, so no line announces an
        epoch that is not printed: 1/8 ... 7/8 before)."""
        if steps <= 0:
            return
        r = self.s.retraining
        per_epoch = math.ceil(self.ds.n_train / r.batch_size)
        augment = None if r.shift_probability <= 0 else functools.partial(
            random_shift, probability=r.shift_probability, fill=self.ds.background)
        whole, rest = divmod(steps, per_epoch)
        for epochs, upto in ((whole, whole * per_epoch), (whole + 1, steps) if rest else (0, 0)):
            if epochs:
                trainer.fit(self.ds, epochs=epochs, max_steps=upto,
                            batch_size=r.batch_size, progress=self.progress,
                            evaluate=False, augment=augment)


def deep_compress(net: Network, ds: Dataset, model: dict[str, Any],
                  settings: CompressionSettings | None = None, out: str | None = None,
                  progress: bool = True, log: Callable[[str], None] | None = None
                  ) -> CompressionResult:
    """Compress the trained ``net`` (whose builder ``model`` names: ``name``,
    ``input_shape``, ``num_classes``, ``width``) on dataset ``ds``; write the file to ``out``
    (atomically) when given. ``net``'s weights end as the decompressed model's."""
    s = settings or CompressionSettings()
    s.check(net)
    say = log or (lambda _: None)
    layers = [c.layer for c in compressible_weights(net)]
    prune = parse_setting(s.prune, "--prune", fraction, "", layers)
    bits = parse_setting(s.bits, "--bits", bit_width, "", layers)
    index_bits = parse_setting(s.index_bits, "--index-bits", bit_width, "", layers)
    targets = {c.param.name: c for c in compressible_weights(net)}
    stages = _Stages(net, ds, s, progress)
    accuracy: dict[str, float | None] = {}

    t = stages.trainer(stages.optimizer(net.parameters()))
    accuracy["baseline"] = stages.accuracy(t)
    t.close()
    say(f"baseline: top-1 {100 * accuracy['baseline']:.2f}%")

    masks: dict[str, np.ndarray] = {}
    for r in range(s.rounds):
        for name, c in targets.items():
            frac = schedule(prune.for_layer(c.layer, c.kind), s.rounds)[r]
            masks[name] = magnitude_mask(to_host(c.param.data), frac)
        opt = MaskedOptimizer(stages.optimizer(net.parameters()), masks)
        t = stages.trainer(opt)
        opt.apply()
        kept = sum(int(m.sum()) for m in masks.values()) / sum(m.size for m in masks.values())
        stages.train(t, s.retraining.steps)
        last = r == s.rounds - 1
        acc = stages.accuracy(t) if last or s.evaluate_rounds else None
        if acc is not None:
            accuracy["pruned" if last else f"pruned {r + 1}/{s.rounds}"] = acc
        t.close()
        say(f"pruning round {r + 1}/{s.rounds}: {100 * kept:.1f}% of the weights kept"
            + ("" if acc is None else f", top-1 after {s.retraining.steps} retraining steps "
                                      f"{100 * acc:.2f}%"))

    shared: dict[str, SharedWeights] = {}
    for name, c in targets.items():
        w = to_host(c.param.data) * masks[name]
        shared[name] = share_weights(w, bits.for_layer(c.layer, c.kind))
        c.param.data[...] = shared[name].dense(c.param.dtype)
    opt = ClusterOptimizer(net.parameters(), shared,
                           lambda ps: stages.optimizer(ps, finetune=True))
    t = stages.trainer(opt)
    accuracy["quantized"] = stages.accuracy(t)
    say(f"weight sharing: top-1 {100 * accuracy['quantized']:.2f}% before fine-tuning")
    stages.train(t, s.retraining.steps)
    decompressed = t.predict(ds.x_test, s.eval_batch_size).argmax(axis=1)
    accuracy["fine-tuned"] = float((decompressed == ds.y_test).mean())
    t.close()
    say(f"shared values fine-tuned for {s.retraining.steps} steps: top-1 "
        f"{100 * accuracy['fine-tuned']:.2f}%")

    records: dict[str, bytes] = {}
    rows: list[report.LayerRow] = []
    for name, p in net.named_parameters(include_buffers=True):
        layer = name.rpartition(".")[0]
        if name in shared:
            c = targets[name]
            ib = index_bits.for_layer(c.layer, c.kind)
            records[name] = weight_record.shared_record(shared[name].codes,
                                                        shared[name].codebook,
                                                        shared[name].bits, ib)
            rows.append(report.shared_row(name, c.layer, c.kind, shared[name], ib,
                                          records[name]))
        else:
            records[name] = weight_record.raw_record(to_host(p.data))
            rows.append(report.raw_row(name, layer, p.data, records[name]))
    cm = CompressedModel(dict(model), records,
                         {"mean": st.mean, "std": st.std} if (st := ds.standardization) else {})
    result = CompressionResult(cm, rows, accuracy)
    data = container.to_bytes(cm)
    result.file_bytes = len(data)
    if out is not None:
        container.write(cm, out)
    result.model = container.from_bytes(data, os.fspath(out) if out else "the compressed model")
    logits = CompressedRunner(result.model).predict(ds.x_test, s.eval_batch_size)
    accuracy["huffman (from the file)"] = float((logits.argmax(axis=1) == ds.y_test).mean())
    result.predictions_match = bool((decompressed == logits.argmax(axis=1)).all())
    return result
