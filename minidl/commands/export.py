"""``minidl export``: a trained checkpoint (``minidl train --save``) as an ONNX file for
inference (:func:`minidl.interop.onnx_export.export_onnx`).

A ``.npz`` checkpoint does not store the model's name, so ``--model`` gives it (a
``.safetensors`` file from ``minidl train --save`` names it in its metadata). The sizes
``minidl train`` chose are read back from the weights where they show: the classes from the
classifier, ``--width`` from the first convolution, a text model's vocabulary and width from
its embedding, a transformer's context from its position table. An image model's input
(which the weights fix only up to a global pooling) is ``--input``, else the first of the
model's default and the usual dataset sizes whose network the weights fit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import zipfile
import zlib
from typing import Any

import numpy as np

from ..interop.checkpoint import damage
from ..interop.onnx_export import (
    DEFAULT_OPSET,
    HEADS,
    OnnxExportError,
    dynamic_dims,
    export_onnx,
    run_onnx,
)
from ..interop.safetensors_io import SafetensorsError, load_safetensors
from ..net.graph import Network
from ..train.trainer import Trainer
from ..zoo.models import SEQUENCE_MODELS, TRANSFORMER_MODELS, default_seq_len
from ..zoo.models import default_vocab as model_vocab
from .common import (
    RuntimeFailure,
    UsageError,
    build_model,
    check_model_name,
    check_output_path,
    format_bytes,
    own_input_shape,
    parse_chw,
    require_module,
)

#: Image sides tried, after the model's default, when --input is not given (digits 8,
#: MNIST 28, CIFAR 32, downsampled ImageNet 64, ImageNet 224).
SIDES = (8, 28, 32, 64, 224)
#: Weights whose rows are a sequence model's vocabulary (and columns its width).
EMBEDDINGS = ("embedding.weight", "transformer.wte.weight",
              "bert.embeddings.word_embeddings.weight")
POSITIONS = ("transformer.wpe.weight", "bert.embeddings.position_embeddings.weight")
#: The largest |difference| --check accepts, relative to the largest |output| (float32).
CHECK_TOLERANCE = 1e-4


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export`` subcommand's flags."""
    e = sub.add_parser("export", help="write a trained checkpoint as an ONNX file for inference")
    e.add_argument("checkpoint", help="a checkpoint written by minidl train --save (.npz, or "
                                      ".safetensors)")
    e.add_argument("--onnx", required=True, metavar="FILE", help="the ONNX file to write")
    e.add_argument("--model", default=None,
                   help="the model the checkpoint was trained as (lenet5, resnet20, char-lstm, "
                        "gpt-char, ...); needed for .npz (default: a .safetensors file's own)")
    e.add_argument("--input", metavar="CxHxW", default=None,
                   help="per-sample input of the image models as trained (default: the model's "
                        "own, else the first usual size, 8, 28, 32, 64 or 224, the weights fit)")
    e.add_argument("--seq-len", type=int, default=None,
                   help="sequence length of the text models (default: a transformer's context "
                        "from its weights, 64 for the char RNNs; the exported length is dynamic "
                        "except for the unrolled RNNs)")
    e.add_argument("--width", type=int, default=None,
                   help="--width the model was trained with (default: read from the weights)")
    e.add_argument("--classes", type=int, default=None,
                   help="output classes of the image models (default: read from the weights)")
    e.add_argument("--vocab", type=int, default=None,
                   help="vocabulary of the text models (default: read from the weights)")
    e.add_argument("--head", default="logits", choices=HEADS,
                   help="the outputs: the network's logits, or softmax / log_softmax over the "
                        "last axis appended")
    e.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                   help="ONNX opset (17 or newer; from 20 GELU is ONNX's Gelu)")
    e.add_argument("--check", action="store_true",
                   help="run the file with onnxruntime on a random batch and compare with "
                        "minidl's own inference (needs onnxruntime)")
    e.add_argument("--batch-size", type=int, default=2, help="samples in the --check batch")
    e.add_argument("--seed", type=int, default=0, help="random seed of the --check batch")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_export, memory="none")


# ------------------------------------------------------------------------------ checkpoint
def read_checkpoint(path: str) -> tuple[dict[str, np.ndarray], str | None]:
    """The parameters of a ``minidl train --save`` file and the model name it stores (a
    ``.safetensors`` file's ``minidl.model``; ``None`` for ``.npz``). A missing, damaged or
    foreign file is a one-line :class:`UsageError`."""
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint {path}: no such file"
                         + (" (it is a folder)" if os.path.isdir(path) else ""))
    if path.lower().endswith(".safetensors"):
        require_module("safetensors", "io", f"checkpoint {path}")
        from safetensors import safe_open

        try:
            params = load_safetensors(path)
            with safe_open(path, framework="np") as f:
                name = (f.metadata() or {}).get("minidl.model")
        except (SafetensorsError, OSError) as e:
            raise UsageError(str(e)) from None
        return params, name
    try:
        with np.load(path, allow_pickle=False) as z:
            if "trainer/iteration" not in z.files:
                raise UsageError(f"checkpoint {path} is not a minidl checkpoint (no "
                                 "trainer/iteration entry); write one with minidl train --save")
            return {k[6:]: z[k] for k in z.files if k.startswith("param/")}, None
    except zipfile.BadZipFile as e:
        raise UsageError(f"checkpoint {path} is damaged ({damage(e)})") from None
    except (ValueError, OSError, EOFError, AttributeError, KeyError, zlib.error):
        raise UsageError(f"checkpoint {path} is not a minidl checkpoint (.npz written by "
                         "minidl train --save)") from None


def mismatch(net: Network, params: dict[str, np.ndarray]) -> str | None:
    """Why ``params`` is not ``net``'s state dict (first difference), or ``None``."""
    own = {name: p.shape for name, p in net.named_parameters(True)}
    missing = [k for k in own if k not in params]
    if missing:
        return f"{missing[0]} is missing from the checkpoint"
    extra = sorted(set(params) - set(own))
    if extra:
        return f"the checkpoint has {extra[0]}, which {net.name} has not"
    for k, shape in own.items():
        if tuple(params[k].shape) != tuple(shape):
            return f"{k} has shape {tuple(params[k].shape)} in the checkpoint, {shape} here"
    return None


def _first(params: dict[str, np.ndarray], names: tuple[str, ...]) -> np.ndarray | None:
    return next((params[n] for n in names if n in params), None)


def _build_sequence(name: str, args, params) -> tuple[Network, tuple[int, ...]]:
    emb = _first(params, EMBEDDINGS)
    vocab = args.vocab or (emb.shape[0] if emb is not None and emb.ndim == 2
                           else model_vocab(name))
    width = args.width or (int(emb.shape[1]) if emb is not None and emb.ndim == 2 else None)
    pos = _first(params, POSITIONS) if name in TRANSFORMER_MODELS else None
    seq_len = args.seq_len or (int(pos.shape[0]) if pos is not None and pos.ndim == 2
                               else default_seq_len(name))
    net = build_model(name, (seq_len,), int(vocab), width)
    why = mismatch(net, params)
    if why:
        raise UsageError(f"checkpoint {args.checkpoint} does not match {name} (vocabulary "
                         f"{vocab}{f', width {width}' if width else ''}, sequence {seq_len}): "
                         f"{why}")
    return net, (seq_len,)


def _classifier(net: Network) -> str | None:
    """The state-dict name of the last 2-D weight (the classifier's)."""
    names = [n for n, p in net.named_parameters() if n.endswith("weight") and len(p.shape) == 2]
    return names[-1] if names else None


def _build_image(name: str, args, params) -> tuple[Network, tuple[int, ...]]:
    given = parse_chw(args.input)
    start = given or own_input_shape(name)
    first = build_model(name, start, args.classes or 10, args.width)
    head = _classifier(first)
    classes = args.classes or (int(params[head].shape[0]) if head in params else 10)
    convs = [(n, p.shape) for n, p in first.named_parameters() if len(p.shape) == 4]
    width = args.width
    if width is None and convs and convs[0][0] in params and "lenet" not in name:
        found = int(params[convs[0][0]].shape[0])
        width = None if found == convs[0][1][0] else found
    if given:
        shapes = [given]
    else:
        c0, *hw = own_input_shape(name)
        channels = [int(params[convs[0][0]].shape[1])] if convs and convs[0][0] in params \
            else [c0, *({1, 3} - {c0})]
        shapes = [(c, *hw) for c in channels] + [(c, s, s) for c in channels for s in SIDES]
    tried, fits = [], []
    for shape in dict.fromkeys(shapes):
        try:
            same = shape == tuple(start) and classes == (args.classes or 10) \
                and width == args.width
            net = first if same else build_model(name, shape, classes, width)
        except UsageError as e:  # too small for the model
            tried.append(f"{'x'.join(map(str, shape))}: {e}")
            continue
        why = mismatch(net, params)
        if why is None:
            fits.append((net, shape))
        else:
            tried.append(f"{'x'.join(map(str, shape))}: {why}")
    if not fits:
        hint = "" if given else "; give the --input (and --width) it was trained with"
        raise UsageError(f"checkpoint {args.checkpoint} does not match {name} ({classes} "
                         f"classes{f', width {width}' if width else ''}, input {tried[0]}){hint}")
    net, shape = fits[0]
    if len(fits) > 1 and not dynamic_dims(net, shape):  # a file for one size: which one?
        sizes = ", ".join("x".join(map(str, s)) for _, s in fits)
        raise UsageError(f"checkpoint {args.checkpoint}: the weights fit {name} on inputs of "
                         f"{sizes}; give the --input it was trained with")
    return net, shape


def load_model(args) -> tuple[Network, tuple[int, ...], str]:
    """The network of ``args.checkpoint`` with its weights, its per-sample input and name."""
    params, stored = read_checkpoint(args.checkpoint)
    name = args.model or stored
    if name is None:
        raise UsageError(f"checkpoint {args.checkpoint}: give --model NAME (a .npz checkpoint "
                         "does not store the model's name; e.g. --model lenet5)")
    check_model_name(name)
    build = _build_sequence if name in SEQUENCE_MODELS else _build_image
    net, shape = build(name, args, params)
    net.load_state_dict(params)
    return net, shape, name


# ------------------------------------------------------------------------------ command
def _random_batch(net: Network, shape: tuple[int, ...], batch: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(net.inputs[0].dtype), np.integer):
        vocab = getattr(net, "vocab_size", None) or 2
        return rng.integers(0, vocab, (batch, *shape), dtype=np.int64)
    return rng.standard_normal((batch, *shape)).astype(net.dtype)


def check_file(net: Network, path: str, shape: tuple[int, ...], batch: int, seed: int,
               head: str) -> dict[str, Any]:
    """onnxruntime's outputs on a random batch beside minidl's eval-mode ones."""
    x = _random_batch(net, shape, batch, seed)
    ref = Trainer(net).predict(x).astype(np.float64)
    if head != "logits":
        ref = ref - ref.max(axis=-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(axis=-1, keepdims=True))
        ref = np.exp(ref) if head == "softmax" else ref
    got = run_onnx(path, x)[0]
    diff = float(np.abs(got - ref).max())
    scale = max(float(np.abs(ref).max()), 1.0)
    return {"check_batch": list(x.shape), "max_abs_difference": diff,
            "max_abs_output": float(np.abs(ref).max()), "matches": diff <= CHECK_TOLERANCE * scale}


def cmd_export(args: argparse.Namespace) -> int:
    require_module("onnx", "onnx", "minidl export --onnx")
    check_output_path("--onnx", args.onnx, "ONNX model")
    if args.check and importlib.util.find_spec("onnxruntime") is None:
        raise RuntimeFailure("minidl export --check runs the file with onnxruntime, which is "
                             "not installed: pip install onnxruntime")
    net, shape, name = load_model(args)
    try:
        model = export_onnx(net, args.onnx, shape, opset=args.opset, head=args.head)
    except OnnxExportError as e:
        raise UsageError(str(e)) from None
    except OSError as e:
        raise RuntimeFailure(f"cannot write {args.onnx}: {e}") from None
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    report: dict[str, Any] = {
        "model": name, "onnx": args.onnx, "input": dims, "opset": args.opset,
        "head": args.head, "parameters": net.num_parameters(),
        "bytes": os.path.getsize(args.onnx)}
    if args.check:
        report |= check_file(net, args.onnx, shape, args.batch_size, args.seed, args.head)
    if args.json:
        print(json.dumps(report))
    else:
        built = "" if dims[1:] == list(shape) else f" (built for {'x'.join(map(str, shape))})"
        print(f"wrote {args.onnx}: {name}, input ({', '.join(map(str, dims))}){built}, "
              f"{report['parameters']:,} parameters, opset {args.opset}, "
              f"{format_bytes(report['bytes'])}")
        if args.check:
            print(f"onnxruntime vs minidl on a batch of {args.batch_size}: max |difference| "
                  f"{report['max_abs_difference']:.3g} (outputs up to "
                  f"{report['max_abs_output']:.3g}): "
                  f"{'match' if report['matches'] else 'DIFFER'}")
    if args.check and not report["matches"]:
        raise RuntimeFailure(f"{args.onnx}: onnxruntime's outputs differ from minidl's by up to "
                             f"{report['max_abs_difference']:.3g}")
    return 0
