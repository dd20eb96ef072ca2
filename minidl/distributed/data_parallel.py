"""Data-parallel training: every rank trains on its shard of each global batch, and the
gradients are averaged across ranks in buckets as backward produces them (PyTorch DDP's
bucketing, Li et al. 2020).

* **Shards.** Rank ``r`` of ``N`` takes the contiguous rows :func:`shard_bounds` gives of
  every global batch (the batches themselves are the single-process ones: same seed, same
  order, same augmentation), so the ranks' shards are disjoint and cover the epoch.
* **Buckets.** The trainable parameters, in reverse order of the network (backward produces
  the last layer's gradients first), are cut into buckets of about ``bucket_bytes``
  (:func:`make_buckets`). After each backward step the executor calls
  :meth:`GradientSync.on_backward_step`; a bucket whose every gradient is final (its
  parameter's last gradient write in the program has run), once every earlier bucket has
  gone (DDP's order: all ranks issue the same collectives in the same order), is copied,
  scaled by the rank's share of the batch, into the bucket's host buffer and all-reduced
  (summed) on a communication thread while backward goes on. :meth:`GradientSync.finish`
  launches what is left (parameters without a gradient step; every bucket when the batch ran
  as micro-batches), waits, and the summed buffers are copied back into ``.grad``.

  The sum of share-weighted shard gradients is the global batch's mean gradient, up to
  summation order. The bucket buffers are host memory outside the device pool (as DDP's
  bucket views are outside the caching allocator's plan), slots of a
  :class:`~.bucket_ring.BucketRing` taken by the buckets in flight.
* **ZeRO stage 2** (``zero=2``, :mod:`minidl.distributed.zero`): the buckets are reduce-scattered
  instead of all-reduced (``Communicator.reduce_scatter_v``): inside a bucket the parameters
  lie in network order, so a bucket is one flat range of the parameters, and each rank
  receives the part of it within its owned range
  (:func:`~minidl.memory.passes.zero.owned_ranges`), straight into its gradient shards. A
  parameter's full gradient is then a block of the iteration: the backward step that last
  writes it copies it (scaled by the share) into its bucket's buffer, and the executor frees
  it right after. Even on one rank the gradients go through the buckets (into the shards).
  Under ``zero=3`` the executor also calls :attr:`DataParallel.before_step` before each
  step (the step's parameters all-gathered from the ranks' shards, on a duplicate
  communicator so that it never interleaves with the gradient thread's).
* **offload=optimizer**: the gradients land in the host's buffers, where the host's update
  reads them; :class:`~.offload_sync.OffloadSync` averages the same buckets there, in place.
* **BatchNorm** normalises with each rank's own shard statistics (DDP's default); running
  statistics stay per rank and rank 0's are the ones checkpoints hold. With ``sync_bn`` it
  normalises with the global batch's (:class:`BatchStatsSync`, on a duplicate of the
  communicator so that its collectives never interleave with the gradient thread's); every
  rank then needs rows in every batch.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..memory.ir.names import Phase
from ..memory.passes.zero import owned_ranges
from .bucket_ring import BucketRing
from .comm import Communicator

#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of an ``n``-row batch that rank ``rank`` of ``size`` trains on:
    contiguous, disjoint, covering the batch, sizes differing by at most one (a batch smaller
    than ``size``, such as an epoch's last, leaves the last ranks none)."""
    if n < 1:
        raise ValueError("an empty batch cannot be trained on")
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def make_buckets(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of parameters (of the given byte sizes, in network order) grouped into buckets
    in reverse order: a bucket is closed once it holds at least ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(nbytes))):
        current.append(i)
        filled += nbytes[i]
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class SyncStats:
    """One step's communication: bytes all-reduced, time spent in the collectives (on the
    communication thread), and the part of it the main thread waited for after backward."""

    buckets: int
    bytes: int
    comm_s: float
    exposed_s: float

    @property
    def hidden_fraction(self) -> float:
        """Share of the collectives' time hidden under backward (1 - exposed / comm)."""
        if self.comm_s <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.exposed_s / self.comm_s))


class GradientSync:
    """Bucketed gradient averaging for the trainable ``params`` over ``comm`` (see the module
    docstring). ``overlap=False`` all-reduces every bucket after backward, on the caller's
    thread.

    ``shards`` (ZeRO stage 2: the :class:`~minidl.distributed.zero.ShardParameter` objects of this
    rank,
    each with its own gradient ``own_grad``): the buckets are reduce-scattered instead, rank
    ``r`` receiving the elements of the bucket in its owned range
    (:func:`~minidl.memory.passes.zero.owned_ranges` over ``params`` flattened in order), which go
    into the shards' gradients; a parameter's full gradient (a block of the iteration) is
    copied into its bucket's buffer by the backward step that last writes it, before the
    executor frees it.
    """

    def __init__(self, comm: Communicator, params: Sequence[Any],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 shards: Sequence[Any] | None = None) -> None:
        self.comm = comm
        self.params = [p for p in params if p.trainable]
        self.overlap = overlap
        self.buckets = make_buckets([p.data.nbytes for p in self.params], bucket_bytes)
        self._bucket_of = {}
        self._offsets: list[list[int]] = []
        counts, kinds = [], []
        sizes = [int(np.prod(p.shape)) for p in self.params]
        for b, members in enumerate(self.buckets):
            dtypes = {np.dtype(self.params[i].dtype) for i in members}
            if len(dtypes) > 1:
                raise ValueError(f"bucket {b} mixes parameter dtypes {sorted(map(str, dtypes))}")
            # in network order inside the bucket: a bucket is one flat range of the parameters
            first = min(members)
            self._offsets.append([sum(sizes[first:i]) for i in members])
            for i in members:
                self._bucket_of[i] = b
            counts.append(sum(sizes[i] for i in members))
            kinds.append(dtypes.pop())
        #: The buckets' host buffers, taken as they fill and given back once summed
        self._ring = BucketRing(counts, kinds)
        self._bytes = sum(n * d.itemsize for n, d in zip(counts, self._ring.dtypes))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: Stage 2: per bucket, the elements each rank receives, this rank's receive buffer
        #: and where its pieces go ((shard, its start in the receive buffer)).
        self.scatter = shards is not None
        self._counts: list[list[int]] = []
        self._recv: list[np.ndarray] = []
        self._pieces: list[list[tuple[Any, int]]] = []
        if shards is not None:
            self._plan_scatter(sizes, shards)
        self._filled: list[bool] = [False] * len(self.params)
        self._ready_cache: dict[int, tuple[Any, dict[int, list[tuple[int, int]]]]] = {}
        self._pending: list[int] = []
        self._launched: list[bool] = []
        self._share = 1.0
        self._queue: queue.Queue = queue.Queue()
        self._comm_s = 0.0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.last: SyncStats | None = None

    def _plan_scatter(self, sizes: list[int], shards: Sequence[Any]) -> None:
        """The reduce-scatter of each bucket (stage 2; see the class docstring)."""
        size, rank = self.comm.size, self.comm.rank
        mine = owned_ranges(sizes, size, rank)
        theirs = [(p.base, p.lo, p.hi) for p in shards]
        if [(id(self.params[i]), lo, hi) for i, lo, hi in mine] != \
                [(id(b), lo, hi) for b, lo, hi in theirs]:
            raise ValueError("ZeRO: the optimizer's shards are not this rank's owned ranges "
                             "of the network's trainable parameters (the optimizer must hold "
                             "every trainable parameter, in the network's order)")
        shard_len = -(-sum(sizes) // size)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        for members in self.buckets:
            a, b = int(starts[min(members)]), int(starts[max(members) + 1])
            counts = [max(0, min(b, (r + 1) * shard_len) - max(a, r * shard_len))
                      for r in range(size)]
            self._counts.append(counts)
            self._recv.append(np.empty(counts[rank], dtype=self._ring.dtypes[len(self._recv)]))
            pieces, pos = [], 0
            for p, (i, lo, hi) in zip(shards, mine):
                if i in members:
                    pieces.append((p, pos))
                    pos += hi - lo
            if pos != counts[rank]:
                raise AssertionError(f"bucket pieces {pos} != received {counts[rank]}")
            self._pieces.append(pieces)

    # ------------------------------------------------------------------ per step
    def begin(self, share: float) -> None:
        """Start a step in which this rank's gradients count ``share`` of the global batch."""
        self._share = float(share)
        self._pending = [len(m) for m in self.buckets]
        self._launched = [False] * len(self.buckets)
        self._filled = [False] * len(self.params)
        self._comm_s = 0.0
        self._error = None
        self._ring.reset()

    @property
    def host_bytes(self) -> int:
        """Host bytes of the buckets' buffers (the ring's slots made so far)."""
        return self._ring.nbytes

    @property
    def unlaunched(self) -> int:
        """Buckets of the current step not handed to the communication thread yet."""
        return self._launched.count(False)

    def _ready_after(self, executor: Any) -> dict[int, list[tuple[int, int]]]:
        """Step index -> parameters (our indices) whose last gradient write is that step, each
        with its gradient's tensor id."""
        prog = executor.plan.program
        hit = self._ready_cache.get(id(prog))
        if hit is not None and hit[0] is prog:
            return hit[1]
        last: dict[int, tuple[int, int]] = {}
        for i, st in enumerate(executor.steps):
            if st.phase != Phase.BACKWARD:
                continue
            for k, g in st.backward.grad_params.items():
                p = executor.parameters.get(st.forward.params[k])
                if p is not None and id(p) in self._index:
                    last[self._index[id(p)]] = (i, g)
        ready: dict[int, list[tuple[int, int]]] = {}
        for j, (i, g) in last.items():
            ready.setdefault(i, []).append((j, g))
        self._ready_cache[id(prog)] = (prog, ready)
        return ready

    def on_backward_step(self, executor: Any, index: int) -> None:
        """The executor's hook after backward step ``index``: launch the buckets it completed."""
        for j, g in self._ready_after(executor).get(index, ()):
            if self.scatter:  # the full gradient is a block of the iteration, freed after
                self._fill(j, executor.last_runtime.array(g))
            self._pending[self._bucket_of[j]] -= 1
        if self.overlap:
            # strictly in bucket order (as DDP): every rank issues the same collectives in the
            # same order, whichever way its plan (or an empty shard) completed them
            b = self._launched.count(True)
            while b < len(self.buckets) and self._pending[b] == 0:
                self._launch(b)
                b += 1

    def _fill(self, i: int, grad: Any) -> None:
        """Parameter ``i``'s gradient, scaled by the rank's share, into its bucket's buffer."""
        b = self._bucket_of[i]
        off = self._offsets[b][self.buckets[b].index(i)]
        np.multiply(grad.reshape(-1), self._share, out=self._ring.take(b)[off:off + grad.size])
        self._filled[i] = True

    def zero_local(self) -> None:
        """This rank has no rows this step: it adds zeros to the sums."""
        for i, p in enumerate(self.params):
            if self.scatter:
                self._filled[i] = False  # zero-filled at launch
            else:
                p.grad[...] = 0

    def _launch(self, b: int) -> None:
        self._launched[b] = True
        buf = self._ring.take(b)
        self._ring.launch(b)
        for i, off in zip(self.buckets[b], self._offsets[b]):
            if self.scatter:  # a parameter no backward step wrote adds zeros
                if not self._filled[i]:
                    buf[off:off + self.params[i].data.size] = 0
                continue
            g = self.params[i].grad
            np.multiply(g.reshape(-1), self._share, out=buf[off:off + g.size])
        self._hand_off(b)

    def _hand_off(self, b: int) -> None:
        """Reduce bucket ``b`` now, or hand it to the communication thread (``overlap``)."""
        if self.overlap:
            self._start_thread()
            self._queue.put(b)
        else:
            self._reduce(b)

    def _reduce(self, b: int) -> None:
        """All-reduce bucket ``b`` and copy the sums back into the gradients (stage 2:
        reduce-scatter it, the owned sums into the shards' gradients)."""
        t0 = time.perf_counter()
        buf = self._ring.take(b)
        if self.scatter:
            recv = self._recv[b]
            self.comm.reduce_scatter_v(buf, recv, self._counts[b])
            self._comm_s += time.perf_counter() - t0
            for p, pos in self._pieces[b]:
                g = p.own_grad
                np.copyto(g.reshape(-1), recv[pos:pos + g.size])
        else:
            self.comm.allreduce(buf)
            self._comm_s += time.perf_counter() - t0
            for i, off in zip(self.buckets[b], self._offsets[b]):
                g = self.params[i].grad
                np.copyto(g, buf[off:off + g.size].reshape(g.shape))
        self._ring.give_back(b)

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="minidl-allreduce",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            b = self._queue.get()
            try:
                if b is None:
                    return
                if self._error is None:
                    self._reduce(b)
            except BaseException as e:  # re-raised on the main thread by finish()
                self._error = e
            finally:
                if b is not None:  # (a failed bucket's slot too: nobody waits for it)
                    self._ring.give_back(b)
                self._queue.task_done()

    def finish(self) -> SyncStats:
        """Launch the buckets not launched yet, wait for every collective, and return the
        step's :class:`SyncStats`; the gradients then hold the global batch's mean."""
        t0 = time.perf_counter()
        for b in range(len(self.buckets)):
            if not self._launched[b]:
                self._launch(b)
        if self.overlap:
            self._queue.join()
        exposed = time.perf_counter() - t0
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        self.last = SyncStats(len(self.buckets), self._bytes,
                              self._comm_s, exposed)
        return self.last

    def abandon(self) -> None:
        """After a failed step: wait for the collectives already launched (so the buffers are
        free) without raising theirs."""
        if self.overlap and self._thread is not None:
            self._queue.join()
        self._error = None

    def close(self) -> None:
        """Stop the communication thread."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None


class BatchStatsSync:
    """``Context.batch_sync`` for synchronised BatchNorm: sums over the ranks of ``comm`` and
    this step's share of the global batch."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.share = 1.0

    def sum(self, values: np.ndarray) -> None:
        """Sum ``values`` (a contiguous float64 array) over the ranks, in place."""
        self.comm.allreduce(values)


def fingerprint(net: Any, spec: str, optimizer: Any, seed: int, size: int,
                sync_bn: bool = False) -> dict[str, str]:
    """What every rank must agree on, as short strings: the world size, the model (name and
    every parameter's name, shape and dtype), the memory spec, the optimizer, the seed and
    whether BatchNorm is synchronised."""
    h = hashlib.sha256()
    for name, p in net.named_parameters(include_buffers=True):
        h.update(f"{name}:{tuple(p.shape)}:{np.dtype(p.dtype).name};".encode())
    optimizer = getattr(optimizer, "inner", optimizer)  # a ZeroOptimizer's
    opt = type(optimizer).__name__
    lr = getattr(optimizer, "lr", None)
    return {"world size": str(size),
            "model": f"{net.name} ({net.num_parameters():,} parameters, {h.hexdigest()[:12]})",
            "memory spec": spec,
            "optimizer": opt if lr is None else f"{opt}(lr={lr:g})",
            "seed": str(seed), "sync_bn": str(bool(sync_bn))}


def check_agreement(comm: Communicator, mine: dict[str, str]) -> None:
    """Raise ``ValueError`` naming the first field on which a rank differs from rank 0 (every
    rank sees the same gathered fingerprints, so every rank raises the same error)."""
    everyone = comm.allgather_object(mine)
    root = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key in root:
            if theirs.get(key) != root[key]:
                raise ValueError(f"data-parallel ranks disagree on the {key}: rank 0 has "
                                 f"{root[key]!r}, rank {rank} has {theirs.get(key)!r}")


class DataParallel:
    """The trainer's side of data parallelism over ``comm``: shards, gradient sync, the
    global loss and logits, parameters broadcast from rank 0, and rank-0-only checkpoints.
    ``sync``: the gradients' sync when not a :class:`GradientSync` over the network's
    parameters (``offload=optimizer``: :class:`~.offload_sync.OffloadSync`)."""

    def __init__(self, comm: Communicator, net: Any, spec: str, optimizer: Any, seed: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                 sync_bn: bool = False, sync: GradientSync | None = None) -> None:
        self.comm = comm
        for _, p in net.named_parameters(include_buffers=True):
            if not isinstance(p.data, np.ndarray):
                raise ValueError(f"data parallelism and ZeRO stages 2-3 (over {comm.name}) run "
                                 f"on the cpu device (host arrays); parameter {p.name} is a "
                                 f"{type(p.data).__name__}")
        check_agreement(comm, fingerprint(net, spec, optimizer, seed, comm.size, sync_bn))
        for _, p in net.named_parameters(include_buffers=True):
            comm.broadcast(p.data, root=0)
        if hasattr(optimizer, "params_changed"):
            optimizer.params_changed()  # (zero=3: into the shards)
        shards = optimizer.shard.params if getattr(optimizer, "shards_gradients", False) \
            else None  # zero=2: reduce-scatter into this rank's gradient shards
        self.sync = sync if sync is not None else GradientSync(
            comm, net.parameters(), bucket_bytes, overlap, shards)
        self.stats: list[SyncStats] = []
        self._idle = False
        #: ``Context.batch_sync`` for the layers (``sync_bn``), else ``None``.
        self.batch_sync = BatchStatsSync(comm.duplicate()) if sync_bn else None
        #: The executor's hook before each step (:class:`~minidl.compile.hooks.StepHooks`):
        #: under ZeRO stage 3 the step's parameters gathered from the ranks' shards, on a
        #: duplicate communicator so it never interleaves with the gradient thread's; else
        #: ``None``.
        self.before_step = optimizer.layer_gather(comm.duplicate()) \
            if getattr(optimizer, "stage", 0) >= 3 else None

    def after_backward_step(self, executor: Any, index: int) -> None:
        """The executor's hook after backward step ``index`` (see :class:`GradientSync`)."""
        self.sync.on_backward_step(executor, index)

    @property
    def is_root(self) -> bool:
        """Whether this rank prints and writes files (rank 0)."""
        return self.comm.rank == 0

    def compute_gradients(self, local: Callable[[np.ndarray, np.ndarray], float],
                          x: np.ndarray, y: np.ndarray) -> float:
        """Run ``local`` (forward and backward on this rank's shard, calling
        :meth:`GradientSync.on_backward_step`) and average the gradients; returns the global
        batch's mean loss."""
        n = len(x)
        lo, hi = shard_bounds(n, self.comm.rank, self.comm.size)
        share = (hi - lo) / n
        self.sync.begin(share)
        self._idle = hi == lo
        if n < self.comm.size and (self.batch_sync is not None
                                   or self.before_step is not None):
            # (every rank knows it: all of them stop, none waits in a collective)
            what = "sync_bn" if self.batch_sync is not None else "zero=3 (per-step gathers)"
            raise ValueError(f"{what} needs rows on every rank: a batch of {n} samples leaves "
                             f"{self.comm.size - n} of the {self.comm.size} ranks none")
        if self.batch_sync is not None:
            self.batch_sync.share = share
        try:
            if self._idle:  # no rows for this rank: it adds nothing but joins the collectives
                self.sync.zero_local()
                loss = 0.0
            else:
                loss = local(x[lo:hi], y[lo:hi])
        except BaseException:
            self.sync.abandon()
            raise
        self.stats.append(self.sync.finish())
        total = np.array([loss * share], dtype=np.float64)
        self.comm.allreduce(total)
        return float(total[0])

    def gather_rows(self, rows: np.ndarray | None) -> np.ndarray | None:
        """Every rank's shard rows (the network outputs) concatenated in rank order (a rank
        without rows this step adds none)."""
        parts = self.comm.allgather_object(None if self._idle else rows)
        parts = [p for p in parts if p is not None]
        return np.concatenate(parts) if parts else None

    def root_writes(self, write: Callable[[], None]) -> None:
        """Rank 0 runs ``write``; every rank returns once it has (a barrier)."""
        try:
            if self.is_root:
                write()
        finally:
            self.comm.barrier()

    def close(self) -> None:
        self.sync.close()
