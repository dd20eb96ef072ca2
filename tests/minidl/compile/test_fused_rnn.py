"""Fused LSTM / GRU nodes through the engine: the fused char models against the unrolled ones,
every lossless memory spec (BPTT schedules included) bit-identical to ``none`` with the dry-run
peak equal to the real one, stash savings of the schedules on long sequences, the per-T builds
of :class:`~minidl.zoo.rnn.SequenceModel` and the schedules as per-step options of the plan."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl import layers as L
from minidl.memory.options.bptt_options import bptt_policy, time_schedule
from minidl.net.optim import SGD
from minidl.zoo.rnn import UNIT_STEPS, SequenceModel, char_rnn, recurrent_fused

VOCAB = 11
SPECS = ["reuse,inplace", "reuse,recompute=sqrt", "reuse,bptt=1", "reuse,bptt=3",
         "reuse,inplace,swap=all", "reuse,recompute=cost"]


def _batch(n=3, t=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, t)), rng.integers(0, VOCAB, (n, t))


def fused_model(cell, steps, unit_steps, emb=6, hidden=7, layers=2, seed=0):
    """char_rnn's fused build (tokens -> fused RNN owning the embedding -> Linear) with a unit
    of ``unit_steps`` steps, so that short sequences already span several units."""

    def build(store, T):
        x = minidl.Input((T,), dtype="int64", name="tokens")
        y = recurrent_fused(store, x, cell, emb, hidden, layers, name=cell,
                            unit_steps=unit_steps, vocab_size=VOCAB)
        fc = L.Linear(hidden, VOCAB)
        fc.name = "fc"
        store.bind(fc, {"weight": "fc.weight", "bias": "fc.bias"})
        return x, fc(y)

    return SequenceModel(build, steps, name=f"char-{cell}-u{unit_steps}", seed=seed,
                         vocab_size=VOCAB)


MODELS = {
    # T = 40 with the default 16-step units: 3 units, the last one short
    "char_rnn": (lambda cell: char_rnn(VOCAB, 6, 7, 2, steps=40, cell=cell), 40),
    # T = 22 in units of 4: 6 units, the last one short
    "units_of_4": (lambda cell: fused_model(cell, 22, 4), 22),
}


def _train(make_net, x, y, spec, steps=3):
    net = make_net()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9), memory=spec,
                        device_memory="8MiB", debug=True)
    losses = [tr.step(x, y) for _ in range(steps)]
    return losses, net.state_dict(), tr


# ---------------------------------------------------------------- fused against unrolled
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_and_unrolled_same_seed_same_parameters(cell):
    a = char_rnn(VOCAB, 6, 7, 2, steps=5, cell=cell).state_dict()
    b = char_rnn(VOCAB, 6, 7, 2, steps=5, cell=cell, fused=False).state_dict()
    assert sorted(a) == sorted(b)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_and_unrolled_train_alike(cell):
    """Same parameter names and shapes; from the same values, 3 SGD steps give the same
    losses and parameters (float32, different computations: close, not identical)."""
    x, y = _batch(t=40)
    fused = char_rnn(VOCAB, 6, 7, 2, steps=40, cell=cell)
    unrolled = char_rnn(VOCAB, 6, 7, 2, steps=40, cell=cell, fused=False)
    start = fused.state_dict()
    assert {k: v.shape for k, v in start.items()} == {
        k: v.shape for k, v in unrolled.state_dict().items()}
    unrolled.load_state_dict(start)
    runs = []
    for net in (fused, unrolled):
        tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.5, momentum=0.9),
                            device_memory="8MiB")
        runs.append(([tr.step(x, y) for _ in range(3)], net.state_dict()))
    (lf, sf), (lu, su) = runs
    np.testing.assert_allclose(lf, lu, rtol=1e-5, atol=1e-6)
    assert lf[2] < lf[0]  # it learns
    for name, v in sf.items():
        np.testing.assert_allclose(v, su[name], rtol=1e-4, atol=1e-5, err_msg=name)
        assert not np.array_equal(v, start[name]) or name == "embedding.weight", name


# ---------------------------------------------------------------- memory specs
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_specs_bit_identical_to_none_and_dry_run_exact(cell, model, spec):
    make, t = MODELS[model]
    x, y = _batch(t=t)
    base_losses, base_state, base_tr = _train(lambda: make(cell), x, y, "none")
    losses, state, tr = _train(lambda: make(cell), x, y, spec)
    assert losses == base_losses, spec
    assert sorted(state) == sorted(base_state)
    for name, v in base_state.items():
        assert np.array_equal(state[name], v), f"{spec}: {name}"
    for s, trainer in (("none", base_tr), (spec, tr)):
        rep = minidl.dry_run(make(cell), 3, s, input_shape=(t,))
        assert rep["peak_allocated_bytes"] == trainer.memory_report()["peak_allocated_bytes"], s
    assert tr.evaluate(x, y) == base_tr.evaluate(x, y)  # eval mode: the same build, forward only
    policy = bptt_policy(spec)
    report = tr.memory_report()
    if policy is None:
        assert "bptt" not in report
    else:
        (row,) = report["bptt"]
        assert row["layer"] == cell and row["units"] == -(-t // row["unit_steps"]) >= 3
        assert row["policy"] == ("sqrt" if policy == "sqrt" else "dp")
        if spec.endswith("bptt=1"):
            assert row["states_kept"] == 1
        assert row["recomputed_flops"] > 0


def test_bptt_policy_and_time_schedule():
    assert bptt_policy(None) is None and bptt_policy("none") is None
    assert bptt_policy("reuse,inplace,swap=all") is None
    assert bptt_policy("reuse,recompute=sqrt") == "sqrt"
    assert bptt_policy("reuse,bptt=3") == "dp:3"
    assert bptt_policy("reuse,recompute=sqrt,bptt=2") == "dp:2"  # bptt=N wins
    for rec in ("cost", "speed", "memory"):
        assert bptt_policy(f"reuse,recompute={rec}") == "dp:sqrt"
    with pytest.raises(ValueError):
        bptt_policy("reuse,bptt=0")
    assert time_schedule("dp:3", 1) is None and time_schedule(None, 10) is None
    s = time_schedule("dp:3", 25)
    assert (s.policy, s.units, s.max_stored) == ("dp", 25, 3)
    assert time_schedule("dp:sqrt", 25).max_stored == 5
    assert time_schedule("sqrt", 25).policy == "sqrt"


# ---------------------------------------------------------------- long sequences
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_schedules_keep_far_fewer_stash_bytes_on_long_sequences(cell):
    t = 400

    def rep(spec):
        return minidl.dry_run(char_rnn(VOCAB, 8, 8, 2, steps=t, cell=cell), 4, spec,
                              input_shape=(t,))

    keep = rep("reuse")
    assert "bptt" not in keep
    for spec, states in (("reuse,recompute=sqrt", None), ("reuse,bptt=4", 4)):
        r = rep(spec)
        (row,) = r["bptt"]
        assert row["units"] == -(-t // UNIT_STEPS)
        if states is not None:
            assert row["states_kept"] == states
        ratio = r["kept_for_backward"]["stash"] / keep["kept_for_backward"]["stash"]
        assert ratio < 0.05, (spec, ratio)
        assert r["kept_for_backward_bytes"] < 0.5 * keep["kept_for_backward_bytes"]
        assert r["peak_allocated_bytes"] < 0.5 * keep["peak_allocated_bytes"], spec


# ---------------------------------------------------------------- builds per T, schedules per plan
def test_for_shapes_caches_per_length_and_shares_parameters():
    net = char_rnn(VOCAB, 6, 7, 2, steps=40)
    params = dict(net.named_parameters())
    assert net.for_shapes([(3, 40)]) is net
    assert net.for_shapes([(5, 40)]) is net  # batch size is no key
    longer = net.for_shapes([(3, 64)])
    assert longer is not net and net.for_shapes([(2, 64)]) is longer
    for b in (net, longer):
        own = dict(b.named_parameters())
        assert sorted(own) == sorted(params)
        assert all(own[k] is params[k] for k in params)
    (layer,) = [nd.layer for nd in net.nodes if isinstance(nd.layer, L.LSTM)]
    assert layer.schedule is None and layer.vocab_size == VOCAB  # no schedule in the layer
    with pytest.raises(ValueError, match="empty sequence"):
        net.for_shapes([(3, 0)])


@pytest.mark.parametrize("spec, policy", [
    ("reuse,bptt=2", "dp"), ("reuse,recompute=sqrt", "sqrt"), ("reuse,inplace", None),
])
def test_the_schedule_is_an_option_of_the_plan_not_of_the_network(spec, policy):
    """One network, one layer object: the plan sets the schedule on the RNN's steps, which
    sizes their stash, and the layer receives it at run time."""
    net = char_rnn(VOCAB, 6, 7, 2, steps=40)
    (layer,) = [nd.layer for nd in net.nodes if isinstance(nd.layer, L.LSTM)]
    tr = minidl.Trainer(net, memory=spec, device_memory="8MiB")
    c = tr.engine.compiled([(3, 40)], (3, 40), True)
    steps = [s for s in c.plan.program.steps if s.layer == "lstm" and s.phase != "recompute"]
    assert {s.phase for s in steps} == {"forward", "backward"}
    scheds = {id(s.op.options.get("bptt")) for s in steps}
    assert len(scheds) == 1  # forward and backward run the same schedule
    sched = steps[0].op.options.get("bptt")
    if policy is None:
        assert "bptt" not in steps[0].op.options
        assert "lstm.states" not in {t.name for t in c.plan.program.tensors}
    else:
        assert (sched.policy, sched.units) == (policy, -(-40 // UNIT_STEPS))
        states = next(t for t in c.plan.program.tensors if t.name == "lstm.states")
        assert states.shape[0] == max(1, sched.max_stored)
    assert layer.schedule is None  # the network was not rebuilt nor changed
    assert c.lowered.layers[steps[0].node] is layer


def test_training_at_another_length_trains_the_shared_parameters():
    net = char_rnn(VOCAB, 6, 7, 2, steps=40)
    # training one build trains them all: a step at T = 64 with bptt=2 moves net's weights
    x, y = _batch(t=64)
    before = net.state_dict()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1), memory="reuse,bptt=2",
                        device_memory="8MiB")
    tr.step(x, y)
    assert tr.memory_report()["bptt"][0]["states_kept"] <= 2
    after = net.state_dict()
    assert all(not np.array_equal(after[k], before[k]) for k in ("lstm.weight_hh_l1",
                                                                 "fc.weight"))


# ---------------------------------------------------------------- budgets and inference
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_auto_budget_picks_a_schedule_that_fits(cell):
    """``auto,budget=`` without bptt=: the engine tries keep-all first, then Gruslys's
    schedules with fewer states, and runs the first that fits; still bit-identical."""
    t = 400
    x, y = _batch(n=4, t=t)

    def make():
        return char_rnn(VOCAB, 8, 8, 2, steps=t, cell=cell)

    base_losses, base_state, _ = _train(make, x, y, "none", steps=2)
    keep = minidl.dry_run(make(), 4, "reuse", input_shape=(t,))
    for budget, scheduled in ((4 << 20, False), (300 << 10, True)):
        spec = f"auto,budget={budget}"
        assert (keep["peak_allocated_bytes"] > budget) == scheduled
        losses, state, tr = _train(make, x, y, spec, steps=2)
        assert losses == base_losses, spec
        for name, v in base_state.items():
            assert np.array_equal(state[name], v), f"{spec}: {name}"
        rep = minidl.dry_run(make(), 4, spec, input_shape=(t,))
        real = tr.memory_report()
        assert rep["peak_allocated_bytes"] == real["peak_allocated_bytes"], spec
        assert real["peak_reserved_bytes"] <= budget
        assert ("bptt" in rep) == ("bptt" in real) == scheduled
        if scheduled:
            (row,) = real["bptt"]
            assert row["units"] == -(-t // UNIT_STEPS)
            assert row["policy"] == "dp" and 1 <= row["states_kept"] < row["units"]
            assert any("BPTT schedule dp:" in note for note in rep["notes"])


def test_auto_budget_schedule_note_survives_the_measured_replan():
    t = 400
    x, y = _batch(n=4, t=t)
    net = char_rnn(VOCAB, 8, 8, 2, steps=t)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9),
                        memory="auto,budget=300KiB", device_memory="8MiB")
    for _ in range(2):
        tr.step(x, y)
        assert tr.memory_report()["bptt"][0]["policy"] == "dp"
        assert any("BPTT schedule dp:" in n for n in tr.memory_report()["notes"])


def test_predict_on_a_sequence_model():
    x, y = _batch(t=20)
    net = char_rnn(VOCAB, 6, 7, 1, steps=20)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1), device_memory="8MiB")
    out = tr.predict(x)
    assert out.shape == (3, 20, VOCAB) and np.all(np.isfinite(out))


def test_evaluate_stays_within_the_auto_budget():
    t, budget = 400, 300 << 10
    x, y = _batch(n=4, t=t)
    net = char_rnn(VOCAB, 8, 8, 2, steps=t)
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.1, momentum=0.9),
                        memory=f"auto,budget={budget}", device_memory="8MiB")
    tr.step(x, y)
    assert tr.memory_report()["peak_allocated_bytes"] <= budget
    tr.evaluate(x, y)
    assert tr.memory_report()["peak_allocated_bytes"] <= budget
