"""``minidl compress``: Deep Compression of a checkpoint written by ``minidl train --save``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
import zlib

import numpy as np

from ..analysis.dryrun import dry_run
from ..compression import container
from ..compression.container import CompressedModelError
from ..compression.inference import plan_inference
from ..compression.layer_spec import compressible_weights
from ..compression.pipeline import (
    CompressionSettings,
    Retraining,
    RetrainOptimizer,
    deep_compress,
)
from ..datasets import data as D
from ..interop.checkpoint import damage
from ..memory.ir.precision import Precision
from ..net.graph import Network
from .common import (
    RuntimeFailure,
    UsageError,
    build_model,
    check_output_path,
    format_bytes,
    print_memory_report,
    shape_and_classes,
)
from .precision_option import print_precision

#: Datasets a compressed image model can be retrained and measured on.
COMPRESS_DATASETS = ("digits", "mnist", "fashion-mnist", "idx")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``compress`` subcommand's flags."""
    c = sub.add_parser("compress", help="Deep Compression of a trained checkpoint: pruning, "
                                        "trained quantization, Huffman coding")
    c.add_argument("checkpoint", help="a checkpoint written by minidl train --save (.npz)")
    c.add_argument("--model", required=True,
                   help="the model the checkpoint was trained as (lenet5, vgg11_bn, ...)")
    c.add_argument("--width", type=int, default=None, help="its --width, if one was given")
    c.add_argument("--dataset", default="digits", help=", ".join(COMPRESS_DATASETS))
    c.add_argument("--data-dir", default=None)
    c.add_argument("--prune", default="0.9",
                   help="fraction of each layer's weights removed: 0.9, or per kind / layer "
                        "such as conv=0.6,fc=0.92,conv1=0.3")
    c.add_argument("--bits", default="conv=8,fc=5",
                   help="bits of the shared-value codes (2**bits - 1 shared values per layer)")
    c.add_argument("--index-bits", default="conv=8,fc=5",
                   help="bits of a relative index (gaps beyond get filler zeros)")
    c.add_argument("--rounds", type=int, default=3, help="pruning rounds")
    c.add_argument("--retrain-steps", type=int, default=300,
                   help="retraining steps after each pruning round, and fine-tuning steps of "
                        "the shared values")
    c.add_argument("--batch-size", type=int, default=64)
    c.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    c.add_argument("--lr", type=float, default=None,
                   help="retraining learning rate (default 0.005 for sgd, 1e-4 for adam)")
    c.add_argument("--finetune-lr", type=float, default=None,
                   help="learning rate of the shared values (default --lr / 10)")
    c.add_argument("--weight-decay", type=float, default=0.0,
                   help="L2 weight decay while retraining (pruned weights stay zero)")
    c.add_argument("--shift", type=float, default=None, metavar="P",
                   help="move each retraining image by one pixel with probability P (default: "
                        "minidl train's for the dataset)")
    c.add_argument("--memory", default="reuse,inplace", help="memory spec of retraining")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--eval-each-round", action="store_true",
                   help="measure the test accuracy after every pruning round, not only the last")
    c.add_argument("--out", required=True, help="the compressed model file to write")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_compress, seq_len=64)


def load_weights(path: str, net: Network) -> None:
    """The parameters of a ``minidl train --save`` checkpoint into ``net``; a file that is not
    one, or of another network, is a one-line :class:`UsageError`."""
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "trainer/iteration" not in z.files:
                raise UsageError(f"checkpoint {path} is not a minidl checkpoint (no "
                                 f"trainer/iteration entry); write one with minidl train --save")
            params = {k[6:]: z[k] for k in z.files if k.startswith("param/")}
    except zipfile.BadZipFile as e:
        raise UsageError(f"checkpoint {path} is damaged ({damage(e)})") from None
    except (ValueError, OSError, EOFError, AttributeError, zlib.error):
        raise UsageError(f"checkpoint {path} is not a minidl checkpoint (.npz written by "
                         f"minidl train --save)") from None
    try:
        net.load_state_dict(params)
    except (KeyError, ValueError) as e:
        raise UsageError(f"checkpoint {path} does not match {net.name} with this --width and "
                         f"dataset: {e.args[0] if e.args else e}") from None


def cmd_compress(args: argparse.Namespace) -> int:
    if args.dataset not in COMPRESS_DATASETS:
        raise UsageError(f"unknown dataset {args.dataset!r}; valid: "
                         f"{', '.join(COMPRESS_DATASETS)}")
    if args.dataset == "idx" and args.data_dir is None:
        raise UsageError("--dataset idx needs --data-dir DIR (a folder of idx files)")
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    if args.retrain_steps < 0:
        raise UsageError(f"--retrain-steps must be >= 0, got {args.retrain_steps}")
    check_output_path("--out", args.out, "compressed model")
    try:
        ds = D.load_dataset(args.dataset, data_dir=args.data_dir, seed=0)
    except (ImportError, OSError, ValueError) as e:
        raise RuntimeFailure(f"cannot load dataset {args.dataset!r}: {e}") from None
    if D.train_defaults(args.dataset).standardize:
        ds.standardize()  # as minidl train did before training the checkpoint
    net = build_model(args.model, ds.input_shape, ds.num_classes, args.width)
    load_weights(args.checkpoint, net)
    shift = D.train_defaults(args.dataset).shift_probability if args.shift is None else args.shift
    settings = CompressionSettings(
        prune=args.prune, bits=args.bits, index_bits=args.index_bits, rounds=args.rounds,
        retraining=Retraining(steps=args.retrain_steps, batch_size=args.batch_size,
                              shift_probability=shift, memory=args.memory, seed=args.seed),
        optimizer=RetrainOptimizer(name=args.optimizer, lr=args.lr,
                                   finetune_lr=args.finetune_lr,
                                   weight_decay=args.weight_decay),
        evaluate_rounds=args.eval_each_round)
    try:
        settings.check(net)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model = {"name": args.model, "input_shape": list(ds.input_shape),
             "num_classes": ds.num_classes, "width": args.width}
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    if log:
        n = sum(c.param.data.size for c in compressible_weights(net))
        log(f"compressing {net.name} ({net.num_parameters():,} parameters, {n:,} in "
            f"convolutions and linear layers) on {ds.name}: prune {args.prune}, bits "
            f"{args.bits}, index bits {args.index_bits}, {args.rounds} rounds of "
            f"{args.retrain_steps} retraining steps")
    result = deep_compress(net, ds, model, settings, out=args.out,
                           progress=not args.no_progress and not args.json, log=log)
    if args.json:
        print(json.dumps(result.as_dict() | {"out": args.out}))
    else:
        print(result.table())
        print(f"wrote {args.out}: {format_bytes(result.file_bytes)}, {result.ratio:.1f}x "
              f"smaller than the {format_bytes(result.dense_bytes)} of float32 parameters; "
              "predictions "
              f"from the file {'match' if result.predictions_match else 'DIFFER FROM'} the "
              f"decompressed model's")
    return 0


def cmd_plan_inference(args: argparse.Namespace) -> int:
    """``minidl plan --inference [--compressed FILE]``: the exact device peak of one inference
    batch, of the model's dense weights (in ``--precision``: mixed keeps float32 weights and
    half copies of the matrix ops' weights for their step) or decoded layer by layer from a
    compressed file."""
    if args.compressed is None:
        if args.model is None:
            raise UsageError("minidl plan --inference needs a MODEL or --compressed FILE")
        shape, classes = shape_and_classes(args)
        net = build_model(args.model, shape, classes, args.width)
        rep = dry_run(net, args.batch_size, "reuse,inplace", input_shape=shape or None,
                      training=False, device_kind=args.device,
                      precision=getattr(args, "precision", Precision.FP32))
        rep["dense_weight_bytes"] = sum(p.nbytes for _, p in net.named_parameters(True))
    else:
        if not args.inference:
            raise UsageError("--compressed FILE plans inference from the file: add --inference")
        try:
            cm = container.read(args.compressed)
            rep = plan_inference(cm, args.batch_size, device_kind=args.device)
        except CompressedModelError as e:
            raise UsageError(str(e)) from None
        if args.model is not None and args.model != cm.model["name"]:
            raise UsageError(f"{args.compressed} holds {cm.model['name']}, not {args.model}")
    if args.json:
        print(json.dumps(rep))
        return 0
    source = (f" from {args.compressed} ({format_bytes(rep['compressed_record_bytes'])} of "
              "records)") if args.compressed else ""
    print(f"{rep['model']}{source}, inference on a batch of {rep['batch_size']}, input "
          f"{'x'.join(map(str, rep['input']))}: {rep['num_steps']} program steps")
    print_memory_report(rep, out=sys.stdout)
    if rep.get("precision"):
        print_precision(rep, out=sys.stdout)
    dense = rep["dense_weight_bytes"]
    print(f"  the dense float32 weights alone: {format_bytes(dense)}; the peak is "
          f"{rep['peak_allocated_bytes'] / dense:.2f}x that")
    return 0
