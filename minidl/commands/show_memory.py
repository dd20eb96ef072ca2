"""``minidl show-memory FILE``: the text report of a memory snapshot (``minidl train
--snapshot``): the peak, the largest tensors live there, the timeline; optionally its PNG plot
and Chrome / Perfetto trace. A ``.pickle`` minidl wrote (PyTorch's snapshot format) is read
from the minidl snapshot inside it; PyTorch's own snapshots are refused in one line saying how
to open them (https://pytorch.org/memory_viz, ``python -m torch.cuda._memory_viz``)."""

from __future__ import annotations

import argparse

from ..analysis.memory_record import load_snapshot, plot_snapshot, show_memory, snapshot_trace
from ..interop.checkpoint import write_json
from .common import RuntimeFailure, UsageError, require_module


def cmd_show_memory(args: argparse.Namespace) -> int:
    if args.top < 1:
        raise UsageError(f"--top must be >= 1, got {args.top}")
    try:
        snap = load_snapshot(args.file)
    except FileNotFoundError:
        raise UsageError(f"{args.file}: no such file (write one with minidl train "
                         "--snapshot FILE)") from None
    except IsADirectoryError:
        raise UsageError(f"{args.file} is a folder, not a memory snapshot") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(show_memory(snap, top=args.top, timeline=not args.no_timeline))
    try:
        if args.plot:
            require_module("matplotlib", "plot", "--plot")
            plot_snapshot(snap, args.plot)
            print(f"timeline saved to {args.plot}")
        if args.trace:
            write_json(args.trace, snapshot_trace(snap))  # (mode 0644 less the umask)
            print(f"trace saved to {args.trace} (open it in https://ui.perfetto.dev)")
    except OSError as e:
        raise RuntimeFailure(f"cannot write {e.filename}: {e.strerror}") from None
    return 0
