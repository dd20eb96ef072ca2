"""The meta dry run: the exact peak of a training iteration, without data or compute."""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ..compile.engine import Engine, micro_shapes
from ..layers import SoftmaxCrossEntropy
from ..layers.base import Layer
from ..memory.cost.cost_model import simulate
from ..memory.cost.targets import DeviceProfile, get_target
from ..memory.devices.device import MetaDevice
from ..memory.ir.config import MemoryConfig
from ..memory.ir.plan import AutoChoice, CurvePoint
from ..memory.ir.units import ALLOCATION_UNIT, format_size, parse_size
from ..memory.passes.zero import STAGES, ZeroBytes, owned_ranges, zero_bytes
from ..memory.planners.auto import BudgetTooSmall
from ..memory.runtime.pool import Pool
from ..net.graph import Network
from ..net.labels import default_label_shape
from ..net.optim import make_optimizer
from . import report
from .memory_record import plan_snapshot


def dry_run(
    net: Network,
    batch_size: int,
    memory: str | MemoryConfig = "none",
    optimizer: str = "sgd",
    loss: Layer | None = None,
    label_shape: tuple[int, ...] | None = None,
    input_shape: tuple[int, ...] | None = None,
    top: int = 10,
    training: bool = True,
    plot: str | None = None,
    trace: str | None = None,
    budget: int | None = None,
    alignment: int = ALLOCATION_UNIT,
    device_kind: str = "cpu",
    scratch_bytes: int | None = None,
    target: str | DeviceProfile | None = None,
    emulated: bool = False,
    ranks: int = 1,
    snapshot: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Run one training iteration of ``net`` on the meta device and report its memory.

    The pool places every block exactly as a real run would, so ``peak_allocated_bytes``
    equals a real run's. Keys: ``peak_allocated_bytes``, ``peak_reserved_bytes``,
    ``lower_bound_bytes``, ``persistent_bytes``, ``breakdown`` (bytes by category at the peak),
    ``peak_step`` (layer, phase, index), ``live_at_peak`` (the largest tensors live there),
    ``split`` and ``micro_batch_size`` (the batch runs as ``split`` micro-batches; the peak and
    ``layers`` are those of one micro-batch, the largest). ``budget`` (bytes, default the auto
    planner's) is drawn as a line on the ``plot``. ``alignment`` is the allocation unit of the
    pool to simulate (that of the real run's pool). ``device_kind="cuda"`` plans for a GPU (its
    layers' workspaces); ``scratch_bytes`` is the block a GPU run reserves for CuPy's own
    temporaries (measured at its first step: ``Trainer.engine.scratch.size``), without which
    the dry run's peak leaves it out.

    ``target`` (a name of :mod:`~minidl.memory.cost.targets` or a profile) plans for that GPU: the
    cuda kind's workspaces, the planners' step times and link rate from its cost model, ``auto``
    without ``budget=`` gets the target's capacity, and the report's ``prediction`` gives the
    predicted iteration time, an unlimited-memory device's (vDNN's oracle), the overhead, the
    stall and the bytes over the host link (:func:`~minidl.memory.cost.cost_model.simulate`).
    ``emulated=True``: the plans a CPU run emulating the target's link makes
    (``Trainer(emulate_link=)``): the target's costs, ``device_kind`` and ``budget`` as given.

    ``ranks``: one rank of data-parallel training over that many ranks: ``batch_size`` is the
    global batch and the iteration is rank 0's shard (the largest); ``zero`` in the report
    gives the rank's persistent bytes under the spec's ``zero=K``
    (:func:`~minidl.memory.passes.zero.zero_bytes`) and the step's collectives, and
    ``peak_allocated_bytes`` is that rank's, as training measures it at every stage (stage 2's
    full gradients and stage 3's gathered parameters are blocks of the lowered iteration).
    ``snapshot``: write the iteration's memory snapshot there
    (:func:`~minidl.analysis.memory_record.plan_snapshot`): PyTorch's snapshot pickle for a
    ``.pickle`` /
    ``.pkl`` path (https://pytorch.org/memory_viz), minidl's JSON (``minidl show-memory``)
    otherwise; the same events and addresses a real run of the spec records.
    """
    config = MemoryConfig.parse(memory)
    profile = get_target(target) if isinstance(target, str) else target
    if profile is not None and not emulated:
        device_kind = "cuda"
        if config.has("auto") and config.budget is None:
            config = MemoryConfig.parse(f"{config.spec},budget={profile.capacity_bytes}")
    shape = tuple(input_shape) if input_shape is not None else net.input_shapes[0]
    if shape is None:
        raise ValueError("the network has no input shape: pass input_shape")
    global_batch = int(batch_size)
    batch_size = -(-global_batch // ranks)  # rank 0's shard
    pool = Pool(MetaDevice(kind=device_kind), alignment=alignment)
    loss = loss if loss is not None else SoftmaxCrossEntropy()
    opt = make_optimizer(optimizer, net.parameters()) if training else None
    engine = Engine(net, pool, config, loss if training else None, opt, bind=False,
                    scratch_bytes=scratch_bytes, target=profile)
    batch = (int(batch_size), *shape)
    labels = tuple(label_shape or default_label_shape(net, batch))
    split = engine.split_for([batch], labels) if training else 1
    micro = -(-int(batch_size) // split)
    if split > 1:
        shapes, labels = micro_shapes([batch], labels, micro)
        c = engine.compiled(shapes, labels, training=True, accumulate=True)
    else:
        c = engine.compiled([batch], labels, training=training)
    c.executor.run([None, None], training=training, record=True)
    info = engine.peak_info(c)
    if snapshot:
        plan_snapshot(c, info, snapshot, model=net.name, memory=config.spec,
                      budget=budget if budget is not None else config.budget)
    if plot:
        report.plot_timeline(report.timeline(c), plot,
                             f"{net.name}, batch {batch_size}, {config.spec}",
                             budget=budget if budget is not None else config.budget)
    if trace:
        report.save_trace(c, trace, measured=False)
    swap = c.executor.last_runtime.swap_stats.as_dict()
    swap["host_peak_bytes"] = engine.host_pool.peak_bytes
    stats = pool.stats()
    prog = c.lowered.program
    zero = zero_bytes(prog, config.zero, ranks) if training and (ranks > 1 or config.zero) \
        else None
    breakdown = dict(info.by_category)
    live = list(info.live)
    lower_bound = prog.lower_bound_bytes()
    notes: list[str] = []
    if zero is not None:  # every figure one rank's (rank 0's shard: the largest)
        stats["allocated_bytes.peak"] -= zero.saved_bytes
        stats["reserved_bytes.peak"] -= zero.saved_bytes
        lower_bound -= zero.saved_bytes
        breakdown, live = _rank_view(prog, zero, breakdown, live)
        notes.append(f"one rank's figures of {ranks}: its peak, breakdown and tensors hold its "
                     f"shard of the {zero_what(zero.stage)}" if zero.stage else
                     f"one rank's figures of {ranks} (no ZeRO: every rank holds the whole "
                     "training state)")
    return {
        "model": net.name,
        "device": "meta" if device_kind == "cpu" else f"meta ({device_kind} kind)",
        "memory": config.spec,
        "batch_size": int(batch_size),
        "input": list(shape),
        "peak_allocated_bytes": stats["allocated_bytes.peak"],
        "peak_reserved_bytes": stats["reserved_bytes.peak"],
        "lower_bound_bytes": lower_bound,
        "persistent_bytes": prog.persistent_bytes() if zero is None
        else sum(zero.persistent.values()),
        "breakdown": dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
        "peak_step": {"layer": info.step, "phase": info.phase, "index": info.position},
        "live_at_peak": [{"tensor": n, "category": c_, "bytes": b} for n, c_, b in live[:top]],
        "num_steps": len(prog.steps),
        "num_tensors": len(prog.tensors),
        "largest_tensor_bytes": max((t.nbytes for t in prog.tensors if not t.persistent),
                                    default=0),
        "host_peak_bytes": engine.host_pool.peak_bytes,
        "split": split,
        "micro_batch_size": micro,
        "kept_for_backward_bytes": sum(c.executor.last_runtime.kept_for_backward.values()),
        "kept_for_backward": dict(c.executor.last_runtime.kept_for_backward),
        "swap": swap if c.plan.swapped else {},
        "notes": ([f"batch split into {split} micro-batches of {micro} (moDNN); the peak and "
                   f"the layer table are one micro-batch's"] if split > 1 else [])
        + list(c.plan.notes) + notes,
        "layers": report.layer_table(c),
        "prediction": {} if profile is None else _prediction(c, profile, split),
        "auto": _auto_report(c.plan.auto, split, prog.lower_bound_bytes()),
        **{k: v for k, v in report.strategy_costs(c).items() if k == "bptt"},
        **({} if zero is None else {"ranks": ranks, "global_batch_size": global_batch,
                                    "zero": _zero_report(zero)}),
    }


def _auto_report(choice: AutoChoice | None, split: int, lower_bound_bytes: int
                 ) -> dict[str, Any]:
    """The frontier planner's curve and choice (empty without one: no ``auto``, or the greedy
    walk). Peaks are one micro-batch's (the device's); times are the whole iteration's, the
    ``split`` micro-batches one after another."""
    if choice is None or not choice.curve:
        return {}
    oracle = (choice.oracle_s or 0.0) * split

    def point(p: CurvePoint) -> dict[str, Any]:
        low = p.lower_bound_s
        return {"peak_bytes": p.peak,
                "peak_over_lower_bound": p.peak / lower_bound_bytes if lower_bound_bytes else None,
                "step_s": p.time_s * split,
                "overhead": p.time_s * split / oracle - 1.0 if oracle > 0 else 0.0,
                "lower_bound_s": None if low is None else low * split,
                "source": p.source, "summary": p.summary, "chosen": p.peak == choice.peak}

    return {"curve": [point(p) for p in choice.curve],
            "chosen_peak_bytes": choice.peak,
            "chosen_step_s": (choice.oracle_s or 0.0) * split + choice.extra_time_s * split,
            "lower_bound_s": None if choice.lower_bound_s is None
            else choice.lower_bound_s * split,
            "oracle_s": oracle, "split": split, "lower_bound_bytes": lower_bound_bytes}


def zero_what(stage: int) -> str:
    """What ZeRO ``stage`` shards, in words."""
    return STAGES.get(stage, "nothing")


def _rank_view(prog: Any, zero: ZeroBytes, breakdown: dict[str, int],
               live: list[tuple[str, str, int]]) -> tuple[dict[str, int],
                                                          list[tuple[str, str, int]]]:
    """The breakdown and the tensors live at the peak as rank ``zero.rank`` holds them: the
    program's persistent bytes of each category replaced by the rank's
    (:func:`~minidl.memory.passes.zero.zero_bytes`), each sharded tensor by its shard (left out
    where
    the rank owns none of it), stage 3's gathered parameter block added where the program
    has none. The breakdown then sums to the rank's peak."""
    program_bytes: dict[str, int] = {}
    for t in prog.tensors:
        if t.persistent:
            program_bytes[t.category] = program_bytes.get(t.category, 0) + \
                prog.block_size(t.nbytes)
    out = dict(breakdown)
    for cat in set(program_bytes) | set(zero.persistent):
        out[cat] = out.get(cat, 0) - program_bytes.get(cat, 0) + zero.persistent.get(cat, 0)
    if zero.gather_bytes and not zero.gathered_in_program:
        out["parameter"] = out.get("parameter", 0) + zero.gather_bytes
    out = {k: v for k, v in out.items() if v}
    # each trainable tensor's shard on this rank
    trainable = [t for t in prog.tensors if t.role == "param_grad"]
    sizes = [math.prod(t.shape) for t in trainable]
    shard = {i: prog.block_size((hi - lo) * (trainable[i].nbytes // max(sizes[i], 1)))
             for i, lo, hi in owned_ranges(sizes, zero.ranks, zero.rank)}
    index = {t.name[:-len(".grad")]: i for i, t in enumerate(trainable)}
    sharded_roles = {1: ("opt_state",), 2: ("opt_state", "param_grad"),
                     3: ("opt_state", "param_grad", "param")}.get(zero.stage, ())
    by_name = {t.name: t for t in prog.tensors}
    rows = []
    for name, cat, nbytes in live:
        t = by_name.get(name)
        if t is not None and t.persistent and t.role in sharded_roles:
            base = name if t.role == "param" else name.rsplit(".", 1)[0]
            i = index.get(base)
            if i is not None:
                nbytes = shard.get(i, 0)
        if nbytes:
            rows.append((name, cat, nbytes))
    rows.sort(key=lambda r: -r[2])
    return out, rows


def _zero_report(z: ZeroBytes) -> dict[str, Any]:
    return {"stage": z.stage, "persistent_bytes": dict(z.persistent),
            "unsharded_bytes": dict(z.unsharded), "saved_bytes": z.saved_bytes,
            "gather_bytes": z.gather_bytes,
            "collectives": [{"name": c.name, "payload_bytes": c.payload_bytes,
                             "sent_bytes_per_rank": c.sent_bytes} for c in z.collectives]}


def _prediction(c: Any, profile: DeviceProfile, split: int) -> dict[str, Any]:
    """The cost model's iteration on ``profile`` (``split`` micro-batches run one after
    another: times and bytes scale with it)."""
    p = simulate(c.plan, profile)
    out = p.as_dict()
    for key in ("step_s", "oracle_s", "stall_s", "recompute_s", "codec_s", "offloaded_bytes",
                "prefetched_bytes"):
        out[key] *= split
    out["target_description"] = profile.describe()
    out["capacity_bytes"] = profile.capacity_bytes
    return out


def frontier(net: Network | Callable[[], Network], batch_size: int,
             input_shape: tuple[int, ...] | None = None, target: str | DeviceProfile | None = None,
             budget: int | str | None = None, optimizer: str = "sgd",
             memory: str = "auto", **kwargs: Any) -> list[dict[str, Any]]:
    """The auto planner's curve for one training iteration of ``net`` (a network, or a function
    making one): every plan no other beats on both peak and predicted step time, by
    increasing peak, from the least the planner reaches to the unconstrained peak.

    Each point is a dict: ``peak_bytes`` (what the run reaches, the persistent state
    included), ``peak_over_lower_bound`` (that over the program's ``lower_bound_bytes``),
    ``step_s`` (predicted seconds per iteration: ``target``'s cost model, else FLOPs at an
    assumed rate), ``overhead`` (over an unlimited-memory device's time), ``lower_bound_s``
    (a certified lower bound at that peak where the planner gives one per point, else None),
    ``source`` and ``summary`` (the plan and what it does) and ``chosen`` (the plan picked for
    ``budget``: bytes or a size such as ``"2GiB"``; default the target's memory, else none).
    The step time never rises with the peak. ``memory`` is an ``auto`` spec (``auto``, or
    with ``split=K`` or ``zero=K``); ``kwargs`` go to :func:`dry_run` (``label_shape``,
    ``device_kind``, ``ranks``, ...). The whole report, with the certified bound at the budget,
    is ``dry_run(...)["auto"]``.

    Raises :class:`~minidl.memory.planners.auto.BudgetTooSmall` when nothing fits ``budget`` and
    ``ValueError`` for a spec without ``auto``."""
    config = MemoryConfig.parse(memory)
    if not config.has("auto"):
        raise ValueError(f"frontier() is the auto planner's curve: memory must contain 'auto', "
                         f"got {config.spec!r}")
    if budget is not None:
        config = MemoryConfig({**config.flags, "budget": str(parse_size(budget))})
    if not isinstance(net, Network):
        net = net()
    rep = dry_run(net, batch_size, config, optimizer, input_shape=input_shape, target=target,
                  **kwargs)
    return list(rep["auto"].get("curve", []))


def auto_device_memory(net: Network, batch_size: int, memory: str | MemoryConfig,
                       optimizer: str, input_shape: tuple[int, ...],
                       device_kind: str = "cpu",
                       emulate_link: str | DeviceProfile | None = None) -> int:
    """Device bytes a run needs: the larger reserved peak of a training and an evaluation
    iteration (dry runs for ``device_kind``), rounded up to a MiB, plus one MiB of headroom.
    On a GPU also room for CuPy's own temporaries, which the first step measures (a dry run
    cannot): the largest tensor of the program (they are masks and small reductions of
    feature maps: at most a quarter of the largest map in the reference models).
    ``emulate_link``: for a run emulating that target's link (its plans)."""
    train = dry_run(net, batch_size, memory, optimizer, input_shape=input_shape,
                    device_kind=device_kind, target=emulate_link, emulated=True)
    evaluate = dry_run(net, batch_size, memory, optimizer, input_shape=input_shape,
                       training=False, device_kind=device_kind, target=emulate_link,
                       emulated=True)
    need = max(train["peak_reserved_bytes"], evaluate["peak_reserved_bytes"])
    if device_kind != "cpu":
        need += max(train["largest_tensor_bytes"], evaluate["largest_tensor_bytes"])
    mib = 1 << 20
    return (-(-need // mib) + 1) * mib


def max_batch_size(make_net: Callable[[], Network], input_shape: tuple[int, ...],
                   memory: str | MemoryConfig, budget: int, optimizer: str = "sgd",
                   limit: int = 1 << 16, progress: bool = False,
                   target: str | DeviceProfile | None = None, device_kind: str = "cpu",
                   workers: int | None = None) -> dict[str, Any]:
    """The largest batch whose dry run fits ``budget`` bytes (reserved peak). With ``auto`` in
    the spec (its ``budget=`` defaults to ``budget``), the planner may also split batches (up
    to 64 micro-batches). ``target`` and ``device_kind`` are :func:`dry_run`'s. Returns
    ``max_batch_size`` (0 if even batch 1 does not fit), the ``report`` of that batch's dry
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
                          progress, target, device_kind)
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
                       device_kind=j["device_kind"])
    except BudgetTooSmall:
        return None


class _BatchSearch:
    """The search of :func:`max_batch_size`: ``known`` maps each batch dry-run with the spec
    to its report when it fitted, else None."""

    def __init__(self, make_net, input_shape, config: MemoryConfig, budget: int, optimizer: str,
                 limit: int, progress: bool, target, device_kind: str) -> None:
        self.job = {"make_net": make_net, "input_shape": tuple(input_shape), "config": config,
                    "optimizer": optimizer, "target": target, "device_kind": device_kind}
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
                      + (f" (peak reserved {format_size(rep['peak_reserved_bytes'])})"
                         if rep is not None else ""), flush=True)

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
                                       device_kind=self.job["device_kind"]
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


#: Specs tried when suggesting what would fit (cheapest in time first).
SUGGESTIONS = ("reuse,inplace", "reuse,inplace,static", "gist,static", "vdnn-all",
               "reuse,inplace,recompute=cost", "reuse,inplace,recompute=sqrt,swap=all,static")


def suggest_specs(make_net, batch_size: int, input_shape: tuple[int, ...], capacity: int,
                  optimizer: str = "sgd") -> list[dict[str, Any]]:
    """Memory specs whose dry-run reserved peak fits ``capacity`` bytes, with their peaks, and
    the auto planner's plan for that budget if it finds one."""
    out = []
    for spec in (*SUGGESTIONS, f"auto,budget={capacity}"):
        try:
            rep = dry_run(make_net(), batch_size, spec, optimizer, input_shape=input_shape)
        except BudgetTooSmall:
            continue
        if rep["peak_reserved_bytes"] <= capacity:
            out.append({"memory": spec, "peak_reserved_bytes": rep["peak_reserved_bytes"],
                        "split": rep["split"]})
    return out
