"""``mpiexec -n N minidl train ...``: the MPI job a command runs in, which rank prints and
writes files, and how the ranks stop together when one fails."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from ..distributed.comm import Communicator, MpiCommunicator
from ..settings import Settings
from .common import EXIT_FAILURE, RuntimeFailure, UsageError

#: Flags naming files or outputs that only rank 0 writes (it holds the same model).
ROOT_ONLY_OUTPUTS = ("log", "trace", "plot", "snapshot", "tensorboard")


def mpi_job(settings: Settings | None = None) -> Communicator | None:
    """The job's communicator when ``mpiexec`` started this process with more than one rank,
    else ``None`` (a plain single-process run never loads MPI)."""
    settings = settings or Settings.from_environment()
    if settings.mpi_ranks <= 1:
        return None
    try:
        return MpiCommunicator()
    except ImportError as e:
        raise RuntimeFailure(str(e)) from None


def quiet_other_ranks(args: argparse.Namespace, comm: Communicator | None) -> None:
    """Ranks other than 0 print nothing and write no logs, traces or plots (the checkpoint is
    written by rank 0 alone inside :meth:`Trainer.save`)."""
    if comm is None or comm.rank == 0:
        return
    args.quiet = args.no_progress = True
    args.json = False
    for flag in ROOT_ONLY_OUTPUTS:
        setattr(args, flag, None)


def refuse_for_text(args: argparse.Namespace, comm: Communicator | None) -> None:
    """The text models' loop samples random windows per step: not sharded."""
    if comm is not None:
        raise UsageError(f"data-parallel training (mpiexec, {comm.size} ranks) is for the image "
                         f"models; {args.model} trains on random windows of text in one process")


@contextlib.contextmanager
def ranks_stop_together(comm: Communicator | None) -> Iterator[None]:
    """Around the training loop: an error on one rank prints one line naming the rank and
    aborts the whole job, so the other ranks do not wait in a collective forever."""
    if comm is None:
        yield
        return
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"minidl: error: rank {comm.rank} of {comm.size}: {text}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        comm.abort(EXIT_FAILURE)
        raise
