"""Results do not depend on where blocks sit in the arena.

Losses and gradients must be the same bits whatever offsets a plan gives its blocks (another
static layout, the same layout moved up), whatever the pool's allocation unit (blocks' absolute
addresses aligned to 64 bytes or to a page), and whatever a block held before (the debug pool
poisons every byte outside a live block, including bytes never handed out yet). And ``auto``
under any budget it meets with the whole batch is bit-identical to ``none`` on random networks.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import minidl
from minidl import layers as L
from minidl.memory.devices.device import CpuDevice
from minidl.memory.ir.plan import Alloc, Prefetch
from minidl.memory.options import workspace_options
from minidl.memory.planners.auto import BudgetTooSmall
from minidl.memory.runtime.pool import Pool
from minidl.net.optim import SGD


def _concat_net():
    """x -> ReLU -> Concat(relu, x) -> GlobalAvgPool2d -> Linear (the first report's net)."""
    x = minidl.Input((1, 6, 6))
    out = L.Linear(2, 5)(L.GlobalAvgPool2d()(L.Concat(axis=1)(L.ReLU()(x), x)))
    return x, out


def _conv_net():
    x = minidl.Input((2, 6, 6))
    a = L.ReLU()(L.Conv2d(2, 3, 3, padding=1)(x))
    b = L.Add()(L.Tanh()(L.Conv2d(3, 3, 1)(a)), a)
    c = L.MaxPool2d(2)(L.Concat(axis=1)(b, L.LeakyReLU(0.1)(a)))
    return x, L.Linear(6, 5)(L.GlobalAvgPool2d()(c))


NETS = {"concat": _concat_net, "conv": _conv_net}


def _data(shape, seed=0, n=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 5, n)


def _trainer(net, spec, **kw):
    return minidl.Trainer(net, SGD(net.parameters(), lr=0.05, momentum=0.9), memory=spec,
                          device_memory="64MiB", debug=True, **kw)


def _results(net, tr, x, y, steps=2):
    losses = [tr.step(x, y) for _ in range(steps)]
    return losses, {n: np.array(p.grad) for n, p in net.named_parameters()}, \
        {n: np.array(v) for n, v in net.state_dict().items()}


def _assert_same_bits(a, b, what):
    assert a[0] == b[0], f"{what}: losses differ: {a[0]} vs {b[0]}"
    for n in b[1]:
        assert np.array_equal(a[1][n], b[1][n]), f"{what}: gradient of {n} differs"
    for n in b[2]:
        assert np.array_equal(a[2][n], b[2][n]), f"{what}: parameter/buffer {n} differs"


def _baseline(make, x, y):
    net = make()
    return _results(net, _trainer(net, "none"), x, y)


def _relaid(plan, layout):
    """``plan`` (static) with every planned offset moved: ``mirrored`` turns the iteration's
    arena upside down (each block's neighbours change), ``shifted`` moves it up 9 units."""
    prog = plan.program
    base, top = plan.static.base, plan.static.base + plan.static.arena

    def move(a):
        if not isinstance(a, (Alloc, Prefetch)) or a.offset < 0:
            return a
        if layout == "shifted":
            return replace(a, offset=a.offset + 9 * prog.alignment)
        size = prog.block_size(prog.tensors[a.tensor].nbytes)
        return replace(a, offset=base + top - a.offset - size)

    return replace(plan, begin=[move(a) for a in plan.begin],
                   steps=[replace(s, before=[move(a) for a in s.before],
                                  after=[move(a) for a in s.after]) for s in plan.steps])


@pytest.mark.parametrize("layout", ["mirrored", "shifted"])
@pytest.mark.parametrize("model", sorted(NETS))
def test_another_static_layout_gives_the_same_bits(model, layout):
    x_sym, out_sym = NETS[model]()

    def make():
        return minidl.Network(x_sym, out_sym, seed=3)

    x, y = _data(make().input_shapes[0])
    base = _baseline(make, x, y)
    net = make()
    tr = _trainer(net, "reuse,inplace,static")
    c = tr.engine.compiled([x.shape], tuple(y.shape), True, y.dtype.name)
    moved = _relaid(c.plan, layout)
    moved.validate()
    offsets = [(a.tensor, a.offset) for _, a in c.plan.actions() if isinstance(a, Alloc)]
    new = [(a.tensor, a.offset) for _, a in moved.actions() if isinstance(a, Alloc)]
    assert new != offsets  # the layout did change
    tr.engine.replace_plan(c, moved)
    run = _results(net, tr, x, y)
    assert not tr.last_compiled.executor.last_runtime.fallbacks  # every block where planned
    _assert_same_bits(run, base, f"{model}, static layout {layout}")


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("spec", ["none", "reuse,inplace", "reuse,inplace,static"])
def test_the_pools_allocation_unit_does_not_change_the_bits(spec, alignment):
    """64-byte blocks sit at addresses the default 512-byte unit never uses; 4096-byte blocks
    each start a page."""
    x_sym, out_sym = _conv_net()

    def make():
        return minidl.Network(x_sym, out_sym, seed=5)

    x, y = _data(make().input_shapes[0], seed=1)
    base = _baseline(make, x, y)
    net = make()
    run = _results(net, _trainer(net, spec, alignment=alignment), x, y)
    _assert_same_bits(run, base, f"{spec} with {alignment}-byte blocks")


def test_debug_pool_poisons_bytes_never_handed_out():
    """A block from never-used arena bytes reads NaN in debug mode (the arena's initial
    contents, zeros from the OS, would hide a kernel reading before it writes), including a
    gap a fixed offset left below a block."""
    with CpuDevice("1MiB") as dev:
        dev.arena[:] = 0
        pool = Pool(dev, debug=True)
        a = pool.allocate(2048, "a")
        assert np.isnan(a.view(512)).all()
        b = pool.allocate(1024, "b", offset=8192)  # leaves [2048, 8192) free
        assert np.isnan(b.view(256)).all()
        c = pool.allocate(4096, "c", offset=2048)  # inside that gap
        assert np.isnan(c.view(1024)).all()
        a.view(512)[...] = 1.0
        pool.free(a)
        assert np.isnan(pool.allocate(2048, "d").view(512)).all()
        pool.check_invariants()
    with CpuDevice("1MiB") as dev:
        dev.arena[:] = 0
        pool = Pool(dev, debug=False)  # no debug: the pool never writes the arena
        assert not pool.allocate(2048, "a").view(512).any()


# ------------------------------------------------------------------ random networks
OPS = ["conv", "relu", "tanh", "leaky", "bn", "dropout", "add", "concat", "pool"]


@st.composite
def random_networks(draw):
    """(input shape, (input, output, seed)): 2 to 8 ops with fan-out, joins and pooling,
    then global average pooling and a linear layer."""
    c0 = draw(st.integers(1, 3))
    hw = draw(st.sampled_from([4, 6]))
    x = minidl.Input((c0, hw, hw))
    values = [(x, c0, hw)]
    for _ in range(draw(st.integers(2, 8))):
        op = draw(st.sampled_from(OPS))
        v, c, s = values[draw(st.integers(0, len(values) - 1))]
        if op == "conv":
            co, k = draw(st.integers(1, 4)), draw(st.sampled_from([1, 3]))
            values.append((L.Conv2d(c, co, k, padding=k // 2)(v), co, s))
        elif op in ("relu", "tanh", "leaky", "bn", "dropout"):
            layer = {"relu": L.ReLU(), "tanh": L.Tanh(), "leaky": L.LeakyReLU(0.1),
                     "bn": L.BatchNorm2d(c), "dropout": L.Dropout(0.3)}[op]
            values.append((layer(v), c, s))
        elif op == "pool" and s >= 2:
            values.append((L.MaxPool2d(2)(v), c, s // 2))
        elif op in ("add", "concat"):
            same = [w for w in values if w[2] == s and (op == "concat" or w[1] == c)]
            w = same[draw(st.integers(0, len(same) - 1))]
            if op == "add":
                values.append((L.Add()(v, w[0]), c, s))
            else:
                values.append((L.Concat(axis=1)(v, w[0]), c + w[1], s))
    v, c, s = values[-1]
    k = draw(st.integers(0, len(values) - 1))
    if k != len(values) - 1 and values[k][2] == s:  # fan-out into the head
        v, c = L.Concat(axis=1)(v, values[k][0]), c + values[k][1]
    out = L.Linear(c, 5)(L.GlobalAvgPool2d()(v))
    return (c0, hw, hw), (x, out, draw(st.integers(0, 1000)))


def _exact(tr):
    """Whether ``tr``'s last step ran the whole batch with every convolution's default
    configuration: its sums are then in the order of ``none``'s."""
    return tr.observed.last_split == 1 and not any(
        n.startswith(workspace_options.NOTE_PREFIX) for n in tr.last_compiled.plan.notes)


#: A GPU whose host link is slow: swaps stall, so the planners trade them for recomputation.
SLOW_LINK = "custom:flops=15T,hbm=900G,link=2G,mem=16GiB"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_networks(), st.floats(0.0, 1.0), st.sampled_from([None, "greedy", "optimal"]))
def test_auto_between_the_lower_bound_and_the_plain_peak_is_bit_identical(netdef, frac,
                                                                          costed):
    """``auto`` with a budget from the lower bound to ``reuse,inplace``'s peak: bit-identical to
    ``none`` whenever it meets the budget with the whole batch and the convolutions' default
    configurations (by keeping, swapping, recomputing, encoding); below that only micro-batches
    (``split``) or leaner convolution workspaces meet it, which sum in another order (see the
    README): equal to float32 rounding. ``costed``: planned with a slow-linked GPU's costs by
    that planner, the link emulated on the cpu device (the dry run's ``emulated=True``)."""
    shape, (x_sym, out_sym, seed) = netdef

    def make():
        return minidl.Network(x_sym, out_sym, seed=seed)

    link = {} if costed is None else {"target": SLOW_LINK, "emulated": True}
    plain = minidl.dry_run(make(), 4, "reuse,inplace", input_shape=shape, **link)
    low, peak = plain["lower_bound_bytes"], plain["peak_reserved_bytes"]
    for budget in (int(low + frac * (peak - low)), peak):
        spec = f"auto,budget={budget}" + (f",planner={costed}" if costed else "")
        try:
            planned = minidl.dry_run(make(), 4, spec, input_shape=shape, **link)
            break
        except BudgetTooSmall:  # BatchNorm: the batch is never split
            continue
    else:
        assume(False)
    x, y = _data(shape, seed)
    base = _baseline(make, x, y)
    net = make()
    tr = _trainer(net, spec, **({} if costed is None else {"emulate_link": SLOW_LINK}))
    run = _results(net, tr, x, y)
    event("exact plan" if _exact(tr) else "micro-batches or leaner convolutions")
    if _exact(tr):
        _assert_same_bits(run, base, spec)
    elif not any(isinstance(node.layer, L.Dropout) for node in net.nodes):
        # (micro-batches draw their own dropout masks: then not even close)
        np.testing.assert_allclose(run[0], base[0], rtol=1e-5)
        for n, g in base[1].items():
            np.testing.assert_allclose(run[1][n], g, rtol=1e-3, atol=1e-6, err_msg=n)
    tr.last_compiled.plan.validate()
    assert tr.memory_report()["peak_reserved_bytes"] == planned["peak_reserved_bytes"]
