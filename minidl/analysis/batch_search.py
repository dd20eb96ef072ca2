"""The largest batch that fits a budget (:func:`max_batch_size`): dry runs at the batches a
search picks, doubling then bisecting, or guided by the peaks of the leanest fixed plans when
the spec has ``auto`` (its dry runs, each building the planner's whole frontier, are few and
may run in parallel processes)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..memory.cost.targets import DeviceProfile
from ..memory.ir.config import MemoryConfig
from ..memory.ir.precision import Precision
from ..memory.ir.units import format_size
from ..memory.planners.auto import BudgetTooSmall
from ..net.graph import Network
from .meta_run import dry_run


def max_batch_size(make_net: Callable[[], Network], input_shape: tuple[int, ...],
                   memory: str | MemoryConfig, budget: int, optimizer: str = "sgd",
                   limit: int = 1 << 16, progress: bool = False,
                   target: str | DeviceProfile | None = None, device_kind: str = "cpu",
                   workers: int | None = None,
                   precision: Precision | str = Precision.FP32) -> dict[str, Any]:
    """The largest batch whose dry run fits ``budget`` bytes (reserved peak). With ``auto`` in
    the spec (its ``budget=`` defaults to ``budget``), the planner may also split batches (up
    to 64 micro-batches). ``target``, ``device_kind`` and ``precision`` are :func:`dry_run`'s.
    Returns ``max_batch_size`` (0 if even batch 1 does not fit), the ``report`` of that batch's dry
    run, ``limit_reached`` (the answer is ``limit``, larger batches untried) and ``tried``
    (each batch dry-run with the spec, in order, and whether it fitted).

    The answer is exact: that batch's dry run fits and the next one's does not (or it is
    ``limit``). Without ``auto``, by doubling then bisecting. With ``auto`` every dry run
    builds the planner's whole frontier, so few are made: the leanest fixed specs (cheap dry
    runs: plans the auto planner also has) give a first guess and the bytes per sample; each
    round then dry-runs with ``auto`` the batch the largest fitting plan's least peak
    predicts and its neighbour (``workers`` processes, default up to two, one batch each),
    galloping up or bisecting where the prediction fails. The batches tried depend only on
    the dry runs' results and ``workers``, never on timing."""
    config = MemoryConfig.parse(memory)
    if config.has("auto") and config.budget is None:
        config = MemoryConfig({**config.flags, "budget": str(int(budget))})
    search = _BatchSearch(make_net, input_shape, config, int(budget), optimizer, limit,
                          progress, target, device_kind, Precision.of(precision))
    if not config.has("auto"):
        return search.bisect()
    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    return search.guided(max(1, int(workers)))


#: The most micro-batches ``auto`` splits a batch into (the engine's ``split_for``).
MAX_SPLIT = 64

#: The cheap stand-ins for ``auto`` when guessing its largest batch: its leanest fixed plans.
LEAN_SPECS = ("reuse,inplace,recompute=memory,swap=all,static",
              "reuse,inplace,recompute=memory,swap=all,binarize,sparse,static")

#: What a forked worker of :class:`_BatchSearch` dry-runs (set before the workers start).
_JOB: dict[str, Any] = {}


def _job_dry_run(b: int) -> dict[str, Any] | None:
    """One dry run of :data:`_JOB` at batch ``b`` (None: no plan fits)."""
    j = _JOB
    try:
        return dry_run(j["make_net"](), b, j["config"], j["optimizer"],
                       input_shape=j["input_shape"], target=j["target"],
                       device_kind=j["device_kind"], precision=j["precision"])
    except BudgetTooSmall:
        return None


class _BatchSearch:
    """The search of :func:`max_batch_size`: ``known`` maps each batch dry-run with the spec
    to its report when it fitted, else None."""

    def __init__(self, make_net, input_shape, config: MemoryConfig, budget: int, optimizer: str,
                 limit: int, progress: bool, target, device_kind: str,
                 precision: Precision = Precision.FP32) -> None:
        self.job = {"make_net": make_net, "input_shape": tuple(input_shape), "config": config,
                    "optimizer": optimizer, "target": target, "device_kind": device_kind,
                    "precision": precision}
        self.budget, self.limit, self.progress = budget, limit, progress
        self.known: dict[int, dict[str, Any] | None] = {}
        self.order: list[int] = []
        self.step = 1  # (grows while rounds find no failure: the jump above the largest fit)
        self.slope: int | None = None  # (bytes per sample, from the lean specs)
        self.predicted: set[int] = set()  # (fitting batches whose prediction was used)
        config = self.job["config"]
        #: auto may split this network's batches (no batch statistics, no split=K, no ZeRO
        #: stage 2 or 3: :meth:`~minidl.compile.engine.Engine.split_for`)
        self.splits = (config.has("auto") and config.split is None and config.zero < 2
                       and not make_net().buffers())

    # ------------------------------------------------------------------ dry runs
    def run(self, batches: list[int], pool: Any = None) -> None:
        """Dry-run each new batch (in ``pool``'s processes when given), recording whether it
        fits; progress lines in batch order."""
        todo = [b for b in dict.fromkeys(batches) if b not in self.known]
        if pool is not None and len(todo) > 1:
            reps = list(pool.map(_job_dry_run, todo))
        else:
            _JOB.clear()
            _JOB.update(self.job)
            reps = [_job_dry_run(b) for b in todo]
        for b, rep in zip(todo, reps):
            fits = rep is not None and rep["peak_reserved_bytes"] <= self.budget
            self.known[b] = rep if fits else None
            self.order.append(b)
            if self.progress:
                print(f"  batch {b}: {'fits' if fits else 'does not fit'}"
                      + (f" ({self.peak_text(rep['peak_reserved_bytes'])})"
                         if rep is not None else ""), flush=True)

    def peak_text(self, peak: int) -> str:
        """A batch's peak reserved as the progress line shows it: in binary units, with the
        exact bytes against the budget's where both would round to the same figure (1.00 GiB
        that does not fit a 1.00 GiB budget)."""
        if format_size(peak) != format_size(self.budget):
            return f"peak reserved {format_size(peak)}"
        return (f"peak reserved {format_size(peak)} ({peak:,} B) against the budget's "
                f"{self.budget:,} B")

    def bounds(self) -> tuple[int, int]:
        """``(lo, hi)``: the largest batch known to fit (0: none) and the least batch above it
        known not to fit (``limit + 1``: none up to the limit)."""
        lo = max((b for b, r in self.known.items() if r is not None), default=0)
        hi = min((b for b, r in self.known.items() if r is None and b > lo),
                 default=self.limit + 1)
        return lo, hi

    def settled(self) -> bool:
        lo, hi = self.bounds()
        return hi == lo + 1 or lo >= self.limit

    def answer(self) -> dict[str, Any]:
        lo, _ = self.bounds()
        return {"max_batch_size": lo, "report": self.known.get(lo), "limit_reached":
                lo >= self.limit, "tried": [(b, self.known[b] is not None) for b in self.order]}

    def next_probe(self) -> int:
        """Doubling from the largest fitting batch while none above it failed, else the
        middle of the open interval."""
        lo, hi = self.bounds()
        if hi > self.limit:
            return min(max(1, 2 * lo), self.limit)
        return (lo + hi) // 2 if hi - lo > 1 else hi

    # ------------------------------------------------------------------ searches
    def bisect(self) -> dict[str, Any]:
        """Doubling then bisecting, one dry run at a time (the cheap specs')."""
        self.run([1])
        while not self.settled():
            self.run([self.next_probe()])
        return self.answer()

    def guided(self, workers: int) -> dict[str, Any]:
        """Rounds of at most ``workers`` dry runs at the batches a line through the peaks
        predicts (docstring of :func:`max_batch_size`), galloping or bisecting where it
        fails."""
        guess, self.slope = self.lean_guess()
        if guess is not None and self.splits:
            guess = min(self.limit, guess * MAX_SPLIT)  # (the most micro-batches auto makes)
        if self.progress and guess:
            print(f"  the leanest fixed plans predict about batch {guess} "
                  f"({format_size(self.slope)} per sample): checking there with auto",
                  flush=True)
        pool = None
        if workers > 1:
            try:
                ctx = multiprocessing.get_context("fork")
            except ValueError:  # (no fork on this platform: one process)
                ctx = None
            if ctx is not None:
                _JOB.clear()
                _JOB.update(self.job)
                pool = ProcessPoolExecutor(workers, mp_context=ctx)
        try:
            p = guess
            while not self.settled():
                batches = self.proposals(p, workers)
                self.run(batches, pool)
                failed = any(self.known[b] is None for b in batches)
                self.step = 1 if failed else 2 * self.step
                p = self.predict()
        finally:
            if pool is not None:
                pool.shutdown()
        return self.answer()

    def proposals(self, p: int | None, workers: int) -> list[int]:
        """The batches of one round. A prediction ``p`` above the largest fitting batch: ``p``
        (into the open interval) and its neighbour, or after rounds where everything fitted,
        a batch ``step`` above the largest fitting one. Else (the prediction is spent: no
        larger than the largest fit, or made from no new fit) batches galloping up from it,
        or splitting the open interval once a batch above failed."""
        lo, hi = self.bounds()
        # (where auto splits into the most micro-batches, fits depend on the batch over them)
        grain = MAX_SPLIT if self.splits and lo >= MAX_SPLIT else 1

        def snap(b: int) -> int:
            return b // grain * grain if lo < b // grain * grain else b

        if p is not None and p > lo:
            p = snap(min(p, hi - 1))
            jump = snap(min(hi - 1, lo + self.step * grain)) if self.step > 1 else None
            if workers == 1:
                return [max(p, jump or p)]
            step = -1 if p == hi - 1 and p > lo + 1 else 1
            out, b = [], p
            while len(out) < workers - (jump is not None) and lo < b < hi:
                if b not in self.known:
                    out.append(b)
                b += step
            if jump is not None and jump not in out and jump not in self.known:
                out.append(jump)
            if out:
                return sorted(out)
        if hi <= self.limit:  # (a batch above failed: split the room between)
            parts = [snap(lo + (hi - lo) * (k + 1) // (workers + 1)) for k in range(workers)]
            if grain > 1 and lo % grain == 0:  # (lo a whole number of micro-batches: the
                parts = [lo + 1] + parts[:workers - 1]  # next batch needs a larger one)
            out = sorted({b for b in parts if lo < b < hi})
        else:
            out = [b for b in (snap(lo + self.step * grain * 2**k) for k in range(workers))
                   if b <= self.limit]
        return out or [self.next_probe()]

    def predict(self) -> int | None:
        """The largest batch the largest fitting dry run predicts (None: no fit, or this one
        predicted already): its least peak on the planner's curve (one micro-batch's) plus
        :attr:`slope` bytes per sample up to the budget, times its micro-batches (or the
        most auto makes, where it may split)."""
        lo, _ = self.bounds()
        rep = self.known.get(lo)
        if not rep or not self.slope or lo in self.predicted:
            return None
        self.predicted.add(lo)
        least = self.least_peak(rep)
        slope = self.slope
        # (auto's own bytes per sample, where two fits far enough apart tell it)
        first = self.known[min(b for b, r in self.known.items() if r is not None)]
        far = rep["micro_batch_size"] - first["micro_batch_size"]
        if far >= 2 and least > self.least_peak(first):
            slope = -(-(least - self.least_peak(first)) // far)
        micro = rep["micro_batch_size"] + (self.budget - least) // slope
        return max(1, int((MAX_SPLIT if self.splits else rep["split"]) * micro))

    @staticmethod
    def least_peak(rep: dict[str, Any]) -> int:
        """The least peak on the planner's curve of a dry run (one micro-batch's)."""
        curve = rep.get("auto", {}).get("curve") or []
        return min([p["peak_bytes"] for p in curve] + [rep["peak_reserved_bytes"]])

    def lean_guess(self) -> tuple[int | None, int | None]:
        """The largest batch the leanest fixed specs fit (a line through their peaks,
        refined a few times) and their bytes per sample; ``(None, None)`` when they cannot
        tell (nothing fits batch 1, a spec refused)."""
        flags = {k: v for k, v in self.job["config"].flags.items() if k in ("zero", "split")}
        specs = [MemoryConfig({**MemoryConfig.parse(s).flags, **flags}) for s in LEAN_SPECS]
        budget = self.budget

        def peak(b: int) -> int:
            out = []
            for spec in specs:
                try:
                    out.append(dry_run(self.job["make_net"](), b, spec, self.job["optimizer"],
                                       input_shape=self.job["input_shape"],
                                       target=self.job["target"],
                                       device_kind=self.job["device_kind"],
                                       precision=self.job["precision"]
                                       )["peak_reserved_bytes"])
                except (BudgetTooSmall, ValueError):
                    continue
            if not out:
                raise ValueError("no lean spec plans this network")
            return min(out)

        try:
            pts = [(1, peak(1))]
            if pts[0][1] > budget:
                return None, None
            b = 2
            for _ in range(6):  # (work, not time: a few secant steps)
                b = min(max(b, 1), self.limit)
                if b in dict(pts):
                    break
                pts.append((b, peak(b)))
                (b0, p0), (b1, p1) = sorted(pts[-2:])
                slope = max(1, (p1 - p0) // max(1, b1 - b0))
                b = b1 + (budget - p1) // slope
                if abs(b - b1) <= 1:
                    break
        except ValueError:
            return None, None
        fit = [(x, px) for x, px in pts if px <= budget]
        big = sorted(pts)[-2:]
        if len(big) < 2:
            return None, None
        slope = max(1, (big[1][1] - big[0][1]) // max(1, big[1][0] - big[0][0]))
        best = max(fit)
        return min(self.limit, best[0] + (budget - best[1]) // slope), slope
