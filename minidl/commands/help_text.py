"""The words of ``minidl``'s help pages, built from the registries (models, datasets, memory
flags and presets, per-dataset training defaults, optimizers) so that they cannot go stale."""

from __future__ import annotations

import textwrap

from ..datasets import data as D
from ..memory.ir.config import FLAGS, PRESETS
from ..net.optim import make_optimizer
from ..zoo.models import MODEL_NAMES

EMULATE_LINK_HELP = (
    "throttle the cpu device's copy engine so that copy time / compute time is this GPU's "
    "(v100, titanx-maxwell, ... or custom:flops=,hbm=,link=,mem=) and plan with its costs")

#: ``--dataset``'s default for the text models (the image models' is ``digits``).
TEXT_DEFAULT_DATASET = "shakespeare"

#: Help of options that several subcommands share, for those whose parser gives none.
SHARED_HELP = {
    "batch_size": "samples per step",
    "data_dir": "the folder the dataset is read from: its idx files (idx; fashion-mnist when "
                "not in /usr/share/datasets/fashion-mnist)",
    "no_progress": "no progress display",
    "seed": "random seed",
    "optimizer": "the optimizer",
    "classes": "output classes of the image models",
    "json": "print one JSON object",
}


def model_help() -> str:
    """The MODEL argument's help: every model of :data:`minidl.zoo.models.MODEL_NAMES`."""
    return (f"the model: {', '.join(MODEL_NAMES)} (resnet<N>: any valid depth, e.g. resnet20, "
            "resnet56, resnet1001), or your own as MODULE:FUNCTION (a function returning a "
            "minidl Network; it gets input_shape, num_classes and width if it takes them)")


def per_dataset(field: str, fmt=str) -> str:
    """``minidl train``'s default of ``field`` by dataset, from
    :data:`minidl.datasets.data.TRAIN_DEFAULTS`
    (e.g. "120 on digits, else 30")."""
    base = getattr(D.TrainDefaults(), field)
    special = [f"{fmt(getattr(d, field))} on {name}" for name, d in D.TRAIN_DEFAULTS.items()
               if getattr(d, field) != base]
    return ", ".join([*special, f"else {fmt(base)}"]) if special else fmt(base)


def lr_defaults() -> str:
    """The optimizers' default learning rates (:func:`minidl.net.optim.make_optimizer`)."""
    rates: dict[float, list[str]] = {}
    for name in ("sgd", "adam", "adamw"):
        rates.setdefault(make_optimizer(name, []).lr, []).append(name)
    return ", ".join(f"{lr:g} for {'/'.join(names)}" for lr, names in rates.items())


def _flag_form(name: str) -> str:
    values, _ = FLAGS[name]
    if not values:
        return name
    shown = {"<int>": "K" if name == "split" else "N", "<size>": "SIZE"}
    return f"{name}={'|'.join(shown.get(v, v) for v in values)}"


def memory_help() -> str:
    """The memory spec's page (``minidl memory``, ``--memory help``): every flag of
    :data:`minidl.memory.ir.config.FLAGS` and every preset of ``PRESETS``."""
    forms = {name: _flag_form(name) for name in FLAGS}
    width = max(map(len, [*forms.values(), *PRESETS])) + 2
    wrap = textwrap.TextWrapper(width=100, initial_indent="", subsequent_indent=" " * (width + 2))
    lines = [textwrap.fill("memory spec: flags joined by commas, e.g. --memory reuse,inplace,"
                           "swap=conv (in Python: memory=\"reuse,inplace,swap=conv\"); the "
                           "default is none. Every lossless combination gives bit-identical "
                           "losses and gradients.", 100, break_on_hyphens=False), "", "flags:"]
    for name, (_, what) in FLAGS.items():
        lines.append(wrap.fill(f"  {forms[name]:<{width}}{what}"))
    lines += ["", "presets (usable alone or beside flags):"]
    for name, spec in PRESETS.items():
        lines.append(f"  {name:<{width}}{spec}")
    lines += ["", textwrap.fill(
        "--budget SIZE (train, plan) is auto's budget=SIZE. 'minidl plan MODEL --memory SPEC' "
        "gives a spec's exact peak without running it, 'minidl plan MODEL --memory auto "
        "--frontier' the auto planner's whole curve.", 100)]
    return "\n".join(lines) + "\n"


MEMORY_HELP = "memory spec, e.g. reuse,inplace (minidl memory lists every flag and preset)"
EPILOG = ("memory spec: 'minidl memory' (or --memory help) lists every flag and preset; "
          "'minidl COMMAND --help' every option of a command")
