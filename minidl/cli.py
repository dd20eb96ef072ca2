"""The ``minidl`` command: parses the command line of every subcommand (``train``, ``plan``,
``bench``, ``compress``, ``export``, ``show-memory``, ``memory``), checks every flag, runs the
command (:mod:`minidl.commands`) and turns its errors into exit codes.

The help pages are built from the registries (models, datasets, GPU targets, memory flags and
presets, per-dataset training defaults), so they cannot go stale; every option shows its
default."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys

from . import __version__
from .commands.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OOM,
    EXIT_USAGE,
    RuntimeFailure,
    UsageError,
    check_budget_size,
    check_model_name,
    check_output_paths,
    check_plot_path,
    emulated_target,
    format_bytes,
    parse_memory,
    parse_size_flag,
)
from .commands.compress import add_parser as add_compress_parser
from .commands.export import add_parser as add_export_parser
from .commands.help_text import (
    EPILOG,
    SHARED_HELP,
    TEXT_DEFAULT_DATASET,
    memory_help,
)
from .commands.parsers import (
    add_bench_parser,
    add_plan_parser,
    add_show_memory_parser,
    add_train_parser,
)
from .compile.executor import NonFiniteError
from .memory.ir.config import MemoryConfig
from .memory.runtime.host_pool import HostMemoryExceeded
from .memory.runtime.pool import DeviceOutOfMemory
from .settings import Settings
from .zoo.models import SEQUENCE_MODELS


def cmd_memory(args: argparse.Namespace) -> int:
    print(memory_help(), end="")
    return 0


class _Formatter(argparse.HelpFormatter):
    """argparse's help, with each option's default appended where the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if (action.option_strings and d is not None and d is not False
                and d is not argparse.SUPPRESS and "default" not in text.lower()):
            shown = " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)
            text += f" (default: {shown.replace('%', '%%')})"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in one ``minidl: error: ...`` line (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)  # (--epoch 5 is not --epochs 5: it is refused)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, but an unknown option names the one meant (``--epoch``: ``--epochs``)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            _command_parser(self, ns).error(f"unrecognized arguments: {' '.join(extras)}"
                                            f"{_meant(self, ns, extras)}")
        return ns

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"minidl: error: {message} (see '{self.prog} --help')\n")


def _command_parser(parser: argparse.ArgumentParser,
                    ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand ``ns`` ran (``minidl train``), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(ns, "command", None):
            return action.choices[ns.command]
    return parser


def _meant(parser: argparse.ArgumentParser, ns: argparse.Namespace, extras: list[str]) -> str:
    """`` (did you mean --epochs?)`` for the first unknown option of ``extras`` close to one
    of the command's (its prefix, as argparse's abbreviations were, or a near spelling)."""
    options = [o for p in {parser, _command_parser(parser, ns)} for a in p._actions
               for o in a.option_strings]
    for extra in extras:
        name = extra.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        meant = sorted(o for o in options if o.startswith(name) and o != name)
        meant = meant or difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        if meant:
            return f" (did you mean {' or '.join(meant[:3])}? abbreviations are not taken)"
    return ""


def _check_budget(args: argparse.Namespace, configs: list[MemoryConfig]) -> None:
    """``--budget``: given once, and (in ``train``) with ``auto``, whose budget it is; ``plan``
    also compares any spec's plan with it."""
    budget = getattr(args, "budget", None)
    if budget is None:
        return
    if any(c.budget is not None for c in configs):
        raise UsageError(f"--budget {budget} and budget= in --memory {args.memory} both give "
                         "the budget: give it once")
    if getattr(args, "command", None) == "train" and not any(c.has("auto") for c in configs):
        raise UsageError(f"--budget {budget} is the auto planner's budget and does nothing with "
                         f"--memory {args.memory}: use --memory auto --budget {budget}, or size "
                         f"the device arena with --device-memory {budget}")


def _note_one_rank(args: argparse.Namespace, configs: list[MemoryConfig]) -> None:
    """``zero=K`` without ``mpiexec``: one line saying that it runs as one rank."""
    if getattr(args, "command", None) not in ("train", "bench") or getattr(args, "quiet", False):
        return
    zero = max((c.zero for c in configs), default=0)
    if not zero or Settings.from_environment().mpi_ranks > 1:
        return
    why = ("bench times one process, so it" if args.command == "bench" else
           "without mpiexec (mpiexec -n N minidl train ... runs N ranks) this")
    print(f"note: zero={zero} shards the training state over data-parallel ranks; {why} runs as "
          "one rank and shards nothing", file=sys.stderr)


def validate_args(args: argparse.Namespace) -> None:
    """Every number and size on the command line, checked before any work starts: one
    :class:`UsageError` naming the flag, the bad value and what is valid."""
    check_output_paths(args)  # (every command's files: a run must not end unable to write)
    if not hasattr(args, "model"):
        return  # show-memory checks its own
    if args.model is not None:  # plan --compressed FILE takes its model from the file
        check_model_name(args.model)
    if getattr(args, "command", None) == "train" and args.dataset is None:
        args.dataset = TEXT_DEFAULT_DATASET if args.model in SEQUENCE_MODELS else "digits"

    def at_least(flag: str, value, low) -> None:
        if value is not None and not value >= low:  # "not >=" also catches NaN
            raise UsageError(f"{flag} must be >= {low}, got {value}")

    at_least("--batch-size", args.batch_size, 1)
    at_least("--width", args.width, 1)
    at_least("--seq-len", args.seq_len, 1)
    if getattr(args, "val_every", None) == 0:  # (fit's val_every=0: never, as --no-val)
        args.val_every, args.no_val = None, True
    for flag in ("epochs", "max_steps", "classes", "vocab", "steps", "save_every", "log_every",
                 "early_stopping", "val_every"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 1)
    for flag in ("warmup", "seed", "weight_decay"):
        at_least(f"--{flag.replace('_', '-')}", getattr(args, flag, None), 0)
    lr = getattr(args, "lr", None)
    if lr is not None and not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr must be a positive finite number, got {lr}")
    budget = getattr(args, "budget", None)
    check_budget_size(f"--budget {budget}", parse_size_flag("--budget", budget))
    parse_size_flag("--host-memory", getattr(args, "host_memory", None))
    if getattr(args, "device_memory", "auto") != "auto":
        parse_size_flag("--device-memory", args.device_memory)
    specs = args.memory if isinstance(args.memory, list) else [args.memory]
    configs = [parse_memory(spec) for spec in specs]
    _check_budget(args, configs)
    if getattr(args, "plot", None):
        check_plot_path("--plot", args.plot)
    if getattr(args, "emulate_link", None) is not None:
        emulated_target(args.emulate_link, getattr(args, "device", "cpu"))
    _note_one_rank(args, configs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="minidl", epilog=EPILOG, description=(
        "minidl: train networks larger than device memory, and see where every byte went."))
    p.add_argument("--version", action="version", version=f"minidl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    add_train_parser(sub)
    add_plan_parser(sub)
    add_compress_parser(sub)
    add_export_parser(sub)

    add_show_memory_parser(sub)
    add_bench_parser(sub)

    m = sub.add_parser("memory", help="the memory spec: every flag and preset (also: --memory "
                                      "help)")
    m.set_defaults(func=cmd_memory)
    _fill_help(sub)
    return p


def _fill_help(sub: argparse._SubParsersAction) -> None:
    """Options a subcommand's parser left without help get the shared one (SHARED_HELP)."""
    for sp in sub.choices.values():
        for action in sp._actions:
            if action.help is None and action.dest in SHARED_HELP:
                action.help = SHARED_HELP[action.dest]


def main(argv: list[str] | None = None) -> int:
    """Run one command line (``sys.argv[1:]`` by default) and return its exit code. Its output
    piped into a reader that stops early (``minidl show-memory FILE | head -5``) ends it
    quietly; Ctrl-C ends it with one line (``minidl train`` says where, and how to resume)."""
    try:
        code = _main(sys.argv[1:] if argv is None else list(argv))
        sys.stdout.flush()  # (a closed pipe fails here, not at exit)
        return code
    except BrokenPipeError:
        # the reader is gone: what is left to print goes nowhere (not a traceback at exit)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("minidl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # (what minidl train's interrupted run prints to resume it)
    specs = getattr(args, "memory", None)
    if any(str(s).strip().lower() == "help" for s in (specs if isinstance(specs, list)
                                                       else [specs])):
        return cmd_memory(args)
    try:
        validate_args(args)
        return args.func(args)
    except UsageError as e:
        print(f"minidl: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeFailure, NonFiniteError, HostMemoryExceeded) as e:
        print(f"minidl: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except DeviceOutOfMemory as e:
        print(f"minidl: device out of memory\n{e}", file=sys.stderr)
        fits = getattr(e, "suggestions", None)
        if fits:
            print("memory specs whose dry run fits this device memory:", file=sys.stderr)
            for f in fits:
                print(f"  --memory {f['memory']:<48} peak {format_bytes(f['peak_reserved_bytes'])}"
                      + (f", {f['split']} micro-batches" if f["split"] > 1 else ""),
                      file=sys.stderr)
        elif fits is not None:
            print("no memory spec fits this device memory at this batch size: lower the "
                  "batch size or raise --device-memory", file=sys.stderr)
        return EXIT_OOM
    except MemoryError as e:  # the host ran out (NumPy's allocation): one line, not a traceback
        print(f"minidl: error: out of host memory: {e or 'an allocation failed'}",
              file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
