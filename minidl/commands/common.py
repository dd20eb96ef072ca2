"""What the commands share: the command-line errors, model building with a helpful message
for a wrong input shape, flag parsing and the printed memory report."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Any

from ..layers.base import ShapeError
from ..memory.cost.targets import get_target
from ..memory.device_factory import DEVICE_NAMES, make_device
from ..memory.devices.cuda_device import CUDA_INSTALL_HINT
from ..memory.ir.config import MemoryConfig, valid_flags_text
from ..memory.ir.names import DeviceKind
from ..memory.ir.units import format_duration, format_size, parse_size, readable_figures
from ..net.param_memory import ParameterMemoryError
from ..zoo.models import (
    MODEL_NAMES,
    MODELS,
    SEQUENCE_MODELS,
    TRANSFORMER_CONFIGS,
    default_input_shape,
    default_seq_len,
    default_vocab,
    get_model,
    resnet_layout,
)
from ..zoo.user_models import UserModelError, build_user_model, is_user_model

EXIT_USAGE = 2
EXIT_OOM = 1
EXIT_FAILURE = 1
#: A command stopped by Ctrl-C (128 + SIGINT, as the shell's).
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad name or value on the command line (exit code 2)."""


class RuntimeFailure(Exception):
    """A run that cannot go on: missing data, a missing optional extra, no GPU (exit code 1)."""


def parse_chw(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        dims = tuple(int(p) for p in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise UsageError(f"--input must look like CxHxW (e.g. 3x32x32), got {text!r}") from None
    if len(dims) != 3:
        raise UsageError(f"--input {text} has {len(dims)} dimension(s); the image models take "
                         "channels-first CxHxW, three numbers such as 1x28x28 or 3x32x32")
    if any(d <= 0 for d in dims):
        raise UsageError(f"--input dimensions must be positive, got {text!r}")
    return dims


def smallest_square_input(name: str, channels: int, num_classes: int,
                           width: int | None) -> int | None:
    """The smallest H = W that model ``name`` accepts with ``channels`` channels (None above
    4096). Failing sizes fail while the graph is built, before any parameter exists."""
    for side in range(1, 4097):
        try:
            net = get_model(name, input_shape=(channels, side, side), num_classes=num_classes,
                            width=width)
        except ShapeError:
            continue
        if input_collapse(net, (channels, side, side)) is None:
            return side
    return None


def input_collapse(net, input_shape: tuple[int, ...]) -> str | None:
    """Why image input ``input_shape`` (C, H, W) is too small for ``net`` although its shapes
    work out (padding keeps them positive), or None: its first windowed layer (conv or pool)
    has a window larger than the image (it sees mostly padding), or a layer that strides
    gets a map already 1 pixel wide (nothing left to downsample)."""
    shapes, _ = net.infer([(1, *input_shape)])
    first = True
    for node in net.nodes:
        kernel = getattr(node.layer, "kernel_size", None)
        stride = getattr(node.layer, "stride", None)
        shape = shapes[node.in_values[0]] if node.in_values else None
        if not (isinstance(kernel, tuple) and isinstance(stride, tuple) and shape is not None
                and len(shape) == 4 and len(kernel) == 2 and len(stride) == 2):
            continue
        h, w = shape[2:]
        if first and (kernel[0] > h or kernel[1] > w):
            return (f"its first layer, {node.name}, has a {kernel[0]}x{kernel[1]} window, "
                    f"larger than the {h}x{w} image")
        first = False
        if (stride[0] > 1 and h == 1) or (stride[1] > 1 and w == 1):
            return (f"the feature maps have shrunk to {h}x{w} before {node.name}, which "
                    f"downsamples by {stride[0]}x{stride[1]}: the shape collapses there")
    return None


def build_model(name: str, input_shape, num_classes: int, width: int | None = None):
    """The network ``name`` names: a built-in model, or a user's ``MODULE:FUNCTION``
    (:mod:`minidl.zoo.user_models`); one-line usage errors for what cannot be built."""
    try:
        return _build(name, input_shape, num_classes, width)
    except ParameterMemoryError as e:  # (counted before any parameter was allocated)
        if width is None:
            raise UsageError(f"{name}: {e}") from None
        raise UsageError(f"{name} --width {width}: {e}; lower --width") from None


def _build(name: str, input_shape, num_classes: int, width: int | None):
    if is_user_model(name):
        try:
            return build_user_model(name, input_shape, num_classes, width)
        except UserModelError as e:
            raise UsageError(str(e)) from None
    try:
        net = get_model(name, input_shape=input_shape, num_classes=num_classes, width=width)
        collapse = None if input_shape is None or len(input_shape) != 3 else input_collapse(
            net, tuple(input_shape))
        if collapse is None:
            return net
        c, h, w = input_shape
        side = smallest_square_input(name, c, num_classes, width)
        raise UsageError(f"--input {c}x{h}x{w} is too small for {name}: {collapse}"
                         + ("" if side is None else f"; the smallest square input it takes "
                            f"with C={c} is {c}x{side}x{side}"))
    except ShapeError as e:
        if input_shape is None or len(input_shape) != 3:
            raise
        c, h, w = input_shape
        side = smallest_square_input(name, c, num_classes, width)
        if side is None:
            need = f"it takes no input with C={c}"
        elif side == 1:
            need = f"it takes square inputs with C={c} ({c}xHxH)"
        else:
            need = f"the smallest square input it takes with C={c} is {c}x{side}x{side}"
        if w in (1, 3) and c > 3:
            hint = f"; channels last? try --input {w}x{c}x{h}"
        elif side and min(h, w) >= side:
            hint = f"; H and W this unequal are not supported: try {c}x{max(h, w)}x{max(h, w)}"
        else:
            hint = ""
        raise UsageError(
            f"--input {c}x{h}x{w} is too small or the wrong shape for {name} (read channels-first "
            f"as C={c}, H={h}, W={w}): {need}{hint} [{e}]") from None
    except ValueError as e:
        if "unknown model" in str(e) or "no ResNet" in str(e):
            raise UsageError(str(e)) from None
        if name in TRANSFORMER_CONFIGS:  # a width the heads do not divide
            raise UsageError(f"{name}: {e}") from None
        raise


def check_model_name(name: str) -> None:
    """Raise :class:`UsageError` listing the valid names unless ``name`` is a model (a user's
    ``MODULE:FUNCTION`` is checked when it is built)."""
    if name in MODELS or name in SEQUENCE_MODELS or is_user_model(name):
        return
    depth = re.fullmatch(r"resnet(\d+)", name)
    if depth is None:
        raise UsageError(f"unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    try:
        resnet_layout(int(depth.group(1)))
    except ValueError as e:
        raise UsageError(str(e)) from None


def parse_size_flag(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None


#: The files a command writes, by their argparse ``dest``: what each is called in an error.
OUTPUT_FILES = {"save": "checkpoint", "log": "metric log", "trace": "trace",
                "snapshot": "memory snapshot", "plot": "plot", "onnx": "ONNX model",
                "out": "compressed model"}


def check_output_path(flag: str, path: str, noun: str) -> None:
    """``flag PATH``: a file this command will write, checked before any work starts (a run
    that could not write its results at the end would lose them): not a folder, its folder
    there, and a file can be created in it (a real try: ``os.access`` says yes to root, even
    in /proc). One :class:`UsageError` naming the flag, the path and what the file is."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: that is a folder; give the {noun}'s file name")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist (the {noun} cannot "
                         "be written there)")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file is not writable (the {noun} cannot be "
                         "written there)")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".minidl-write-check-")
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create files in folder {folder} "
                         f"({e.strerror or e}): the {noun} cannot be written there") from None
    os.close(fd)
    os.unlink(probe)


def check_output_paths(args: argparse.Namespace) -> None:
    """Every output file of the command line (:data:`OUTPUT_FILES`), checked before any
    work."""
    for dest, noun in OUTPUT_FILES.items():
        path = getattr(args, dest, None)
        if isinstance(path, str) and path:
            check_output_path(f"--{dest}", path, noun)


#: The formats matplotlib's Agg canvas writes (checked against matplotlib itself when it is
#: installed; this list lets a bad name fail before the missing package is mentioned).
AGG_FORMATS = ("avif", "eps", "gif", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg",
               "svgz", "tif", "tiff", "webp")


def check_plot_path(flag: str, path: str) -> None:
    """``--plot FILE``: ``FILE``'s extension one matplotlib writes and matplotlib installed,
    checked before any work (a bad one would otherwise fail after the run)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        kinds = sorted(AGG_FORMATS)
    else:
        kinds = sorted(FigureCanvasAgg(Figure()).get_supported_filetypes())
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in kinds:
        raise UsageError(f"{flag} {path}: "
                         + (f"'.{ext}' is not an image format" if ext else "no extension")
                         + f"; valid: {', '.join('.' + k for k in kinds)}")
    require_module("matplotlib", "plot", f"{flag} {path}")


def require_module(module: str, extra: str, what: str) -> None:
    """Raise :class:`RuntimeFailure` naming the ``pip install`` that provides ``module``."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise RuntimeFailure(f"{what} needs {module}, which is not installed: "
                             f"pip install 'minidl[{extra}]'") from None


def device_name(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (argparse type; one-line error otherwise)."""
    name = text.strip().lower()
    if name in set(DEVICE_NAMES) - {"meta"} or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"invalid device {text!r}: valid devices are cpu, cuda, "
                                     "cuda:N (N the GPU's index) and cuda-strict (the CUDA "
                                     "path checked against CuPy on the CPU, for tests)")


def check_device(name: str) -> None:
    """The cuda device needs CuPy and a GPU: say so before loading data or building models."""
    if not name.startswith("cuda"):
        return
    if importlib.util.find_spec("cupy") is None:
        raise RuntimeFailure(f"--device {name} needs CuPy, which is not installed: "
                             f"{CUDA_INSTALL_HINT}; or use --device cpu")
    if name == "cuda-strict":
        return  # CuPy's API only: no GPU needed
    try:
        make_device(name, capacity=512)  # a tiny arena: CuPy imports and a GPU answers
    except (RuntimeError, ValueError) as e:
        raise RuntimeFailure(f"--device {name}: {without_meta(str(e))}") from None


#: What the device layer suggests instead of a GPU; the commands take --device cpu (the meta
#: device is minidl plan's, which needs no GPU even for --device cuda).
_DEVICE_LAYER_ADVICE = "use the cpu or meta device"
GPU_ALTERNATIVES = ("use --device cpu, or plan for the GPU without one: minidl plan MODEL "
                    "--device cuda")


def without_meta(message: str) -> str:
    """A device error's message with the advice a command can follow (no meta device)."""
    return message.replace(_DEVICE_LAYER_ADVICE, GPU_ALTERNATIVES)


def shape_and_classes(args: argparse.Namespace) -> tuple[tuple[int, ...] | None, int]:
    """Per-sample input shape and output classes: images take --input and --classes; the
    sequence models take --seq-len and --vocab (defaults: the model's context and vocabulary,
    64 and 65 for the character RNNs)."""
    if args.model in SEQUENCE_MODELS:
        seq_len = resolved_seq_len(args)
        vocab = getattr(args, "vocab", None)
        return (seq_len,), default_vocab(args.model) if vocab is None else vocab
    given = parse_chw(args.input)
    return (given if given is not None or is_user_model(args.model)
            else own_input_shape(args.model)), args.classes


#: The input a CIFAR-layout ResNet (a depth other than ImageNet's 18, 34, 50, 101, 152) was
#: made for: CIFAR-10's images.
CIFAR_INPUT = (3, 32, 32)


def own_input_shape(name: str) -> tuple[int, ...]:
    """The input model ``name`` was made for (the commands' default ``--input``): CIFAR's
    3x32x32 for the three-stage ResNets (resnet20, 32, 56, 110, ...), ImageNet's 3x224x224
    for resnet18/34/50/101/152, the zoo's default otherwise."""
    depth = re.fullmatch(r"resnet(\d+)", name)
    if depth is not None:
        try:
            layout = resnet_layout(int(depth.group(1)))
        except ValueError:
            return default_input_shape(name)  # (an invalid depth: refused when built)
        if len(layout[1]) == 3:  # the three-stage CIFAR layout
            return CIFAR_INPUT
    return default_input_shape(name)


def resolved_seq_len(args: argparse.Namespace) -> int:
    """``--seq-len``, or the model's default (:func:`~minidl.zoo.models.default_seq_len`)."""
    seq_len = default_seq_len(args.model) if args.seq_len is None else args.seq_len
    if seq_len < 1:
        raise UsageError(f"--seq-len must be positive, got {seq_len}")
    return seq_len


def emulated_target(name: str, device: str = "cpu"):
    """``--emulate-link``: the target's profile; a bad name, or a device other than the cpu,
    is a one-line usage error."""
    if device != DeviceKind.CPU:
        raise UsageError(f"--emulate-link throttles the cpu device's copy engine: it needs "
                         f"--device cpu, not {device}")
    try:
        return get_target(name)
    except ValueError as e:
        raise UsageError(f"--emulate-link: {e}") from None


def parse_memory(spec: str):
    """``--memory SPEC`` as a :class:`MemoryConfig`; an empty spec, or an empty flag between
    commas, is refused (not read as ``none``)."""
    if isinstance(spec, str):
        if not spec.strip():
            raise UsageError(f"--memory {spec!r} is empty: give none (no memory saving) or "
                             f"flags; valid: {valid_flags_text()}")
        if any(not item.strip() for item in spec.split(",")):
            raise UsageError(f"--memory {spec!r} has an empty flag (a comma too many); valid: "
                             f"{valid_flags_text()}")
    try:
        config = MemoryConfig.parse(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_budget_size(f"--memory {spec}", config.budget)
    return config


#: The largest --budget taken, 1024TiB: more than any device (an H200 has 141 GB), so a size
#: past it is a typo (999999TiB).
MAX_BUDGET = 1 << 50


def check_budget_size(what: str, nbytes: int | None) -> None:
    """A budget of ``nbytes`` (``what`` gives it: the flag and its value) at most
    :data:`MAX_BUDGET`."""
    if nbytes is not None and nbytes > MAX_BUDGET:
        raise UsageError(f"{what}: a budget of {format_size(nbytes)} is more than any device "
                         "holds; give a device's size, up to 1024TiB (e.g. 16GiB)")


def format_bytes(n: int) -> str:
    return f"{format_size(n)} ({n:,} B)"


def print_memory_report(rep: dict[str, Any], out=sys.stdout) -> None:
    print(f"memory report ({rep.get('device', 'meta')} device, memory spec "
          f"{rep.get('memory')!r})", file=out)
    if "capacity_bytes" in rep:
        print(f"  device memory:         {format_bytes(rep['capacity_bytes'])}", file=out)
    print(f"  peak allocated:        {format_bytes(rep['peak_allocated_bytes'])}", file=out)
    print(f"  peak reserved:         {format_bytes(rep['peak_reserved_bytes'])}", file=out)
    if "lower_bound_bytes" in rep:
        print(f"  lower bound:           {format_bytes(rep['lower_bound_bytes'])}", file=out)
    # (an evaluation batch may set the pool's peak: the place and the breakdown below are
    # the training iteration's, so its own peak is printed beside them, in the same phase)
    iteration = rep.get("iteration_peak_bytes")
    split = iteration is not None and iteration != rep["peak_allocated_bytes"]
    if split:
        print(f"  training iteration:    {format_bytes(iteration)} at its peak", file=out)
        if "evaluation_peak_bytes" in rep:
            print(f"  evaluation:            {format_bytes(rep['evaluation_peak_bytes'])} at "
                  f"its peak (batch {rep['evaluation_batch_size']}, eval mode)", file=out)
    if "peak_step" in rep:
        ps = rep["peak_step"]
        print(f"  {'training peak at:' if split else 'peak reached at:':<22} {ps['layer']} "
              f"({ps['phase']}, program step {ps['index']})", file=out)
    if rep.get("breakdown"):
        print("  bytes by category at the "
              + ("training iteration's peak:" if split else "peak:"), file=out)
        total = sum(rep["breakdown"].values()) or 1
        for cat, b in rep["breakdown"].items():
            print(f"    {cat:<17} {format_bytes(b):>32}  {100 * b / total:5.1f}%", file=out)
    live = rep.get("live_at_peak") or rep.get("largest_live")
    if live:
        print("  largest tensors live at the "
              + ("training iteration's peak:" if split else "peak:"), file=out)
        for r in live[:5]:
            print(f"    {r['tensor']:<28} {r['category']:<14} {format_bytes(r['bytes'])}", file=out)
    if rep.get("host_bytes"):
        kinds = rep.get("host_state") or {}
        print(f"  host memory:           {format_bytes(rep['host_bytes'])}"
              + (" (offloaded state: " + ", ".join(f"{k.replace('_', ' ')} {format_size(v)}"
                                                  for k, v in kinds.items() if v)
                 + f"; swap buffers {format_size(rep.get('host_peak_bytes', 0))})"
                 if kinds else " (swap buffers)"), file=out)
    _print_offloaded(rep.get("swap") or {}, out)
    for b in rep.get("bptt", []):
        print(f"  BPTT schedule of {b['layer']}: {b['policy']}, {b['states_kept']} hidden states "
              f"kept for {b['units']} units of {b['unit_steps']} steps, "
              f"{b['unit_forwards'] / b['units']:.2f} unit forwards per unit "
              f"(recomputed {b['recomputed_flops'] / 1e9:.2f} GFLOP)", file=out)
    temps = rep.get("device_temporaries")
    if temps:
        print(f"  CuPy's own temporaries: a scratch block of {format_bytes(temps['scratch_bytes'])}"
              f" (their last step needed {format_size(temps['footprint_bytes'])}"
              + (f"; {format_size(temps['overflow_bytes'])} did not fit it and came from the "
                 "pool" if temps["overflow_bytes"] else "") + ")", file=out)
    outside = rep.get("outside_arena")
    if outside and "libraries_at_start" in outside:
        print(f"  outside the arena:     {format_bytes(outside['total'])} of device memory "
              "(CUDA libraries started with the device "
              f"{format_size(outside['libraries_at_start'])}, loaded since "
              f"{format_size(outside['since_arena'])}; CuPy's own pool "
              f"{format_size(outside['cupy_pool'])})", file=out)
    for note in rep.get("notes", []):
        print(f"  note: {readable_figures(note)}", file=out)


def _print_offloaded(swap: dict[str, Any], out) -> None:
    """A run's ``offload=optimizer`` line: the last step's gradients to the host, parameters
    back, and the host update's and copy back's times."""
    if "uploaded_parameter_bytes" not in swap:
        return
    times = ""
    if swap.get("host_update_s") is not None:
        times = (f"; host update {format_duration(swap['host_update_s'])}, copy back "
                 f"{format_duration(swap['parameter_upload_s'])}")
    streamed = swap.get("streamed_parameter_bytes")
    back = f"parameters {format_size(swap['uploaded_parameter_bytes'])} back" \
        if not streamed else f"parameters {format_size(streamed)} streamed in"
    print(f"  offloaded per step:    gradients {format_size(swap['offloaded_gradient_bytes'])} "
          f"to the host, {back}{times}", file=out)


def with_budget(spec_text: str, budget: str | None) -> str:
    """The spec with ``budget=`` for the auto planner (other specs take --budget only as the
    limit a dry run is compared with)."""
    if budget is None or "auto" not in spec_text.split(","):
        return spec_text
    try:
        return f"{spec_text},budget={parse_size(budget)}"
    except ValueError as e:
        raise UsageError(f"--budget: {e}") from None
