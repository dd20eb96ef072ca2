"""Convolution workspaces chosen for memory (vDNN's rule, memory/options/workspace_options.py,
issue 36):
the default peaks with the rule and with every convolution at its fastest configuration, and
the step time the rule costs.

    python benchmarks/plans/workspace_peaks.py plans                 # dry runs, the meta device (s)
    python benchmarks/plans/workspace_peaks.py step MODEL CxHxW BATCH [PAIRS] [--share X]
    python benchmarks/plans/workspace_peaks.py layers MODEL CxHxW BATCH [ROUNDS] [--share X]

``plans``: vgg16 224 b64, resnet50 224 b32 and alexnet 224 b128 (1000 classes,
``reuse,inplace``): peak allocated / reserved bytes with every convolution at its fastest
configuration (as before the rule), with vDNN's rule as the engine applies it when on (the
least-workspace plan's peak), with some of the peak traded back for time
(``Engine.workspace_time_share = 0.02``: the lowest peak whose caps are estimated to add at
most 2 %), the convolutions capped and the step time the plan's note estimates; then
``vdnn`` / ``vdnn-all`` for vgg16 224 b256 on titanx-maxwell (vDNN's 12 GiB case): the peak
and the cost model's predicted overhead. ``step``: one Trainer with the rule and one without
(``Engine.cap_workspaces = False``), single steps alternated (the order swapped each pair),
the medians and the median of the paired ratios. ``layers``: each convolution the rule caps,
its forward and backward alone at the rule's caps and uncapped (alternated, medians), and the
sum of the differences: the time the rule adds to a step of a model too large to time whole.
``--share X`` applies ``Engine.workspace_time_share = X`` to the rule's side. The rule is off
by default (``workspace_options.RULE_KINDS`` empty: module docstring there); this script turns
it on for the cpu kind, the side without it setting ``Engine.cap_workspaces = False``.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import minidl
from minidl.compile import engine as engine_module
from minidl.kernels.convolution.conv import conv2d_backward, conv2d_forward, conv2d_workspace_bytes
from minidl.kernels.convolution.conv_geometry import conv_config
from minidl.layers import Conv2d, SoftmaxCrossEntropy
from minidl.memory.devices.device import MetaDevice
from minidl.memory.options import workspace_caps as WC
from minidl.memory.options import workspace_options as W
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import SGD
from minidl.zoo.models import get_model

CASES = [("vgg16", (3, 224, 224), 64), ("resnet50", (3, 224, 224), 32),
         ("alexnet", (3, 224, 224), 128)]
#: Issue 36: the default peaks (``minidl plan ... --memory reuse,inplace``, allocated bytes)
#: before the speed work's larger workspaces.
BEFORE = {"vgg16": 5_698_265_088, "resnet50": 3_025_643_520, "alexnet": 1_146_890_240}
SPEC = "reuse,inplace"
CLASSES = 1000


def _option(name: str, default: float | None) -> float | None:
    if name in sys.argv:
        i = sys.argv.index(name)
        value = float(sys.argv[i + 1])
        del sys.argv[i:i + 2]
        return value
    return default


SHARE = _option("--share", None)
W.RULE_KINDS = ("cpu",)  # vDNN's rule where cap_workspaces is on (off by default)


def _engines(rule: bool, share: float | None):
    """Engines made while this is set run vDNN's rule (``rule``) with ``share``; returns the
    constructor to restore."""
    init = engine_module.Engine.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        self.cap_workspaces = rule
        if share is not None:
            self.workspace_time_share = share

    engine_module.Engine.__init__ = patched
    return init


def dry(model, shape, batch, rule: bool, share: float | None = None, spec: str = SPEC,
        target=None):
    init = _engines(rule, share)
    try:
        return minidl.dry_run(get_model(model, shape, CLASSES), batch, spec, input_shape=shape,
                              target=target)
    finally:
        engine_module.Engine.__init__ = init


def _note(r) -> str:
    note = next((n for n in r["notes"] if n.startswith(W.NOTE_PREFIX)), None)
    return "none capped" if note is None else note.split("before -> after): ")[-1]


def plans() -> None:
    print("| model | before the speed work (issue 36) | fastest everywhere | vDNN's rule "
          "(on for cpu) | rule, 2 % traded back |")
    print("|---|---|---|---|---|")
    notes = []
    for model, shape, batch in CASES:
        fast = dry(model, shape, batch, False)
        rule = dry(model, shape, batch, True)
        traded = dry(model, shape, batch, True, 0.02)
        cells = [f"{r['peak_allocated_bytes']:,} / {r['peak_reserved_bytes']:,}"
                 for r in (fast, rule, traded)]
        print(f"| {model} {'x'.join(map(str, shape))} b{batch} | {BEFORE[model]:,} | "
              f"{' | '.join(cells)} |")
        ok = rule["peak_allocated_bytes"] <= BEFORE[model]
        notes.append(f"{model}, rule: {_note(rule)} (allocated peak "
                     f"{'within' if ok else 'ABOVE'} the figure before the speed work)")
        notes.append(f"{model}, 2 % traded back: {_note(traded)}")
    print("\n(allocated / reserved bytes at the peak)\n")
    print("\n".join(f"- {n}" for n in notes))
    print("\nvgg16 3x224x224 b256 on titanx-maxwell (12 GiB; the vDNN paper: 18 % slower on a "
          "12 GB Titan X):\n")
    for spec in ("vdnn", "vdnn-all"):
        r = dry("vgg16", (3, 224, 224), 256, True, spec=spec, target="titanx-maxwell")
        p = r["prediction"]
        fits = r["peak_reserved_bytes"] <= p["capacity_bytes"]
        print(f"- {spec}: peak allocated / reserved {r['peak_allocated_bytes']:,} / "
              f"{r['peak_reserved_bytes']:,} B ({'fits' if fits else 'does NOT fit'} "
              f"{p['capacity_bytes']:,}); predicted step {p['step_s']:.3f} s, oracle "
              f"{p['oracle_s']:.3f} s, overhead {100 * p['overhead']:.1f} % (stall "
              f"{p['stall_s']:.3f} s)")
        for n in r["notes"]:
            if n.startswith(("vDNN's policy", W.NOTE_PREFIX)):
                print(f"  - {n}")


def _trainer(model, shape, batch, rule: bool):
    net = get_model(model, shape, CLASSES)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=SPEC,
                        device_memory=int(1.25 * BEFORE.get(model, 4 << 30)))
    tr.engine.cap_workspaces = rule
    if rule and SHARE is not None:
        tr.engine.workspace_time_share = SHARE
    return tr


def step(model, shape, batch, pairs=4) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, CLASSES, batch)
    trs = {False: _trainer(model, shape, batch, False), True: _trainer(model, shape, batch, True)}
    for tr in trs.values():
        tr.step(x, y)  # compile, warm the kernels
    print([_note({"notes": trs[True].last_compiled.plan.notes})])
    times = {False: [], True: []}
    for r in range(pairs):  # single steps alternated, the order swapped each pair
        for rule in ((False, True) if r % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            trs[rule].step(x, y)
            times[rule].append(time.perf_counter() - t0)
        print(f"pair {r}: fastest {times[False][-1]:.2f} s, rule {times[True][-1]:.2f} s",
              flush=True)
    for rule, name in ((False, "fastest everywhere"), (True, "vDNN's rule")):
        print(f"{name}: median {np.median(times[rule]):.3f} s over {len(times[rule])} steps "
              f"(min {np.min(times[rule]):.3f}, max {np.max(times[rule]):.3f}); peak "
              f"{trs[rule].memory_report()['peak_allocated_bytes']:,} B")
    ratios = np.array(times[True]) / np.array(times[False])
    print(f"rule / fastest: median of the {len(ratios)} paired ratios {np.median(ratios):.3f} "
          f"(min {ratios.min():.3f}, max {ratios.max():.3f}); ratio of medians "
          f"{np.median(times[True]) / np.median(times[False]):.3f}")


def _conv_time(x, w, y, dy, geom, fcap, bcap):
    wsf = np.empty(conv2d_workspace_bytes(*geom, np.float32, False, max_workspace=fcap), np.uint8)
    wsb = np.empty(conv2d_workspace_bytes(*geom, np.float32, True, max_workspace=bcap), np.uint8)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty(w.shape[0], np.float32)
    st, pad, dil = geom[3], geom[4], geom[5]
    t0 = time.perf_counter()
    conv2d_forward(x, w, None, y, st, pad, dil, geom[6], wsf, max_workspace=fcap)
    t1 = time.perf_counter()
    conv2d_backward(x, w, dy, dx, dw, db, st, pad, dil, geom[6], wsb, max_workspace=bcap)
    return t1 - t0, time.perf_counter() - t1


def layers(model, shape, batch, rounds=3) -> None:
    """Per capped convolution: forward and backward at the rule's caps against uncapped."""
    net = get_model(model, shape, CLASSES)
    eng = engine_module.Engine(net, Pool(MetaDevice()), SPEC, SoftmaxCrossEntropy(),
                               SGD(net.parameters(), lr=0.01, momentum=0.9), bind=False)
    if SHARE is not None:
        eng.workspace_time_share = SHARE
    c = eng.compiled([(batch, *shape)], (batch,), True)
    print(_note({"notes": c.plan.notes}))
    caps, shapes = {}, {}
    for st in c.plan.program.steps:
        if st.kind == "conv" and st.phase == "forward" and st.op.options.get(WC.OPTION):
            caps[st.layer] = st.op.options[WC.OPTION]
            shapes[st.layer] = c.plan.program.tensors[st.access.reads[0]].shape
    mods = {node.name: node.layer for node in net.nodes}
    rng = np.random.default_rng(0)
    total = 0.0
    for name, (fcap, bcap) in caps.items():
        m = mods.get(name)
        if not isinstance(m, Conv2d):
            continue
        xs = shapes[name]
        geom = (tuple(xs), m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                m.groups)
        x = rng.standard_normal(xs).astype(np.float32)
        w = (0.05 * rng.standard_normal((m.out_channels, xs[1] // m.groups,
                                         *m.kernel_size))).astype(np.float32)
        y = np.empty(m.output_shapes([xs])[0], np.float32)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        runs = {None: [], True: []}
        _conv_time(x, w, y, dy, geom, None, None)
        _conv_time(x, w, y, dy, geom, fcap, bcap)
        for r in range(rounds):
            for k in ((None, True) if r % 2 == 0 else (True, None)):
                runs[k].append(_conv_time(x, w, y, dy, geom, *((fcap, bcap) if k else
                                                               (None, None))))
        fast = np.median(runs[None], axis=0) * 1e3
        capped = np.median(runs[True], axis=0) * 1e3
        cfg = [conv_config(tuple(xs), m.out_channels, m.kernel_size, m.stride, m.padding,
                           m.dilation, m.groups, 4, b, cap) for b, cap in ((False, fcap),
                                                                          (True, bcap))]
        total += float((capped - fast).sum())
        print(f"{name} {tuple(xs)}: forward {fast[0]:.0f} -> {capped[0]:.0f} ms, backward "
              f"{fast[1]:.0f} -> {capped[1]:.0f} ms; caps {fcap}, {bcap}: "
              f"{cfg[0].algo}/{cfg[1].algo}", flush=True)
    print(f"added by the rule: {total:.0f} ms per step")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "plans"
    if what == "plans":
        plans()
    else:
        model, shape, batch = sys.argv[2], tuple(map(int, sys.argv[3].split("x"))), \
            int(sys.argv[4])
        extra = [int(a) for a in sys.argv[5:]]
        (step if what == "step" else layers)(model, shape, batch, *extra)
