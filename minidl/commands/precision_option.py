"""``--precision``: the option of ``minidl plan`` (every precision) and ``minidl train`` (what
training runs in on the CPU and CUDA devices: fp32, bf16-mixed, fp16-mixed), read as a
:class:`~minidl.memory.ir.precision.Precision` with one-line usage errors naming the valid
values, and the lines a plan in that precision prints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..memory.ir.precision import Precision
from ..memory.ir.units import format_duration
from .common import UsageError, format_bytes

__all__ = ["TRAINABLE", "add_precision_argument", "precision_checked", "precision_of",
           "print_precision"]

#: The precisions a real run computes in (mixed: :mod:`minidl.compile.mixed_steps`;
#: tf32 is a GPU setting).
TRAINABLE = (Precision.FP32, Precision.BF16_MIXED, Precision.FP16_MIXED)


def add_precision_argument(parser: argparse.ArgumentParser, planned: bool) -> None:
    """Add ``--precision`` to ``parser``: every precision for a plan (``planned``), else
    those a run computes in."""
    valid = [p.value for p in (Precision if planned else TRAINABLE)]
    what = ("plan the iteration in this precision: tensors in its dtypes (mixed: autocast's "
            "op lists, float32 master weights), matrix steps at its tensor-core rate on "
            "--target" if planned else "what the run computes in")
    parser.add_argument("--precision", default="fp32", metavar="|".join(valid),
                        help=f"{what} (default: fp32)")


def precision_of(args: argparse.Namespace, planned: bool = True) -> Precision:
    """``--precision`` as a :class:`Precision`; a one-line :class:`UsageError` for an unknown
    name, or (``planned=False``) for one a run cannot compute in yet."""
    text = getattr(args, "precision", "fp32")
    try:
        precision = Precision.of(str(text).strip().lower())
    except ValueError as e:
        raise UsageError(f"--precision: {e}") from None
    if not planned and precision not in TRAINABLE:
        valid = ", ".join(p.value for p in TRAINABLE)
        raise UsageError(f"--precision {precision}: a run computes in {valid} (tf32 is a "
                         f"GPU setting); minidl plan --precision {precision} plans it")
    return precision


def precision_checked(command: Callable[[argparse.Namespace], int]
                      ) -> Callable[[argparse.Namespace], int]:
    """``command`` (a run's: ``minidl train``) after :func:`precision_of` checked that it
    can compute in ``--precision`` (``args.precision`` then the :class:`Precision`)."""

    def run(args: argparse.Namespace) -> int:
        args.precision = precision_of(args, planned=False)
        return command(args)

    run.__doc__, run.__name__ = command.__doc__, command.__name__
    return run


def print_precision(rep: dict, out=sys.stdout) -> None:
    """The lines of ``minidl plan --precision`` other than fp32: bytes at the peak by dtype
    and, on a target, the rates the steps were priced at."""
    by_dtype = ", ".join(f"{dt} {format_bytes(n)}" for dt, n in
                         rep["peak_bytes_by_dtype"].items())
    print(f"precision {rep['precision']}: at the peak {by_dtype}", file=out)
    for name, r in rep.get("rates", {}).items():
        print(f"  {name:<20} {r['rate_flops_per_s'] / 1e12:7.1f} TFLOP/s: {r['steps']} steps, "
              f"{r['flops'] / 1e9:.1f} GFLOP, {format_duration(r['seconds'])} "
              f"({r['bandwidth_bound']} bound by memory bandwidth)", file=out)
