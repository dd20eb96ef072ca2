"""The executor: walks a plan, memory actions through the runtime, compute through the layers."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from .layers.base import Context
from .lowering import ExecStep, Lowered
from .memory import codecs
from .memory.plan import Plan
from .memory.runtime import MemoryRuntime


def plan_exec_steps(lowered: Lowered, plan: Plan) -> list[ExecStep]:
    """The executor's steps for ``plan.program``: the lowered steps, or, for a program a pass
    rewrote (recomputation), each step's original with its tensor substitutions applied."""
    prog = plan.program
    if prog.origins is None:
        return list(lowered.steps)
    out = []
    for st, origin, remap in zip(prog.steps, prog.origins, prog.remaps):
        if origin < 0:  # a step a pass added: encode or decode a stash
            out.append(ExecStep(st.phase, st.layer, None, -1, list(st.reads), list(st.writes),
                                {}, {}, attrs=dict(st.attrs)))
            continue
        ex = lowered.steps[origin]
        if not remap and st.phase == ex.phase and not st.attrs.get("codec_backward"):
            out.append(ex)
            continue
        g = remap.get
        out.append(replace(
            ex, phase=st.phase,
            inputs=[g(t, t) for t in ex.inputs], outputs=[g(t, t) for t in ex.outputs],
            stash={k: g(t, t) for k, t in ex.stash.items()},
            workspace=g(ex.workspace, ex.workspace) if ex.workspace >= 0 else -1,
            grad_outputs=[g(t, t) for t in ex.grad_outputs],
            param_partials={k: g(t, t) for k, t in ex.param_partials.items()},
            attrs={**ex.attrs, **st.attrs},
            grad_inputs=[None if p is None else (g(p[0], p[0]), g(p[1], p[1]) if p[1] >= 0
                                                   else -1) for p in ex.grad_inputs],
        ))
    return out


class NonFiniteError(FloatingPointError):
    """NaN or inf appeared in a layer's output or in the loss."""


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a cheap bijective scramble of 64-bit integers."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


def step_seed(seed: int, iteration: int, node: int) -> int:
    """The reproducible per-(layer, iteration) seed handed to layers (dropout masks): the same
    for a recomputed forward, different for every layer and iteration."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ iteration) ^ node) >> 1


class Executor:
    """Runs one lowered program under one plan on a pool.

    With ``compute=False`` (the meta device) only the memory actions run: the pool places every
    block exactly as in a real run, so the dry-run peak equals the real-run peak.
    """

    def __init__(self, lowered: Lowered, plan: Plan, pool: Any, compute: bool = True,
                 host_pool: Any = None, debug: bool = False) -> None:
        self.lowered = lowered
        self.plan = plan
        self.pool = pool
        self.host_pool = host_pool
        self.debug = debug
        self.compute = compute
        self.last_runtime: MemoryRuntime | None = None
        self.steps = plan_exec_steps(lowered, plan)
        self.codec_state: dict[int, dict] = {}
        #: Largest fraction of non-zeros seen per sparse-encoded tensor (for re-planning).
        self.densities: dict[str, float] = {}
        self.step_times = np.zeros(len(self.steps))

    def run(
        self,
        feeds: list[np.ndarray],
        training: bool = True,
        seed: int = 0,
        iteration: int = 0,
        fetch_outputs: bool = False,
        check_finite: bool = False,
        recomputing: bool = False,
        loss_scale: float = 1.0,
        record: bool = False,
    ) -> tuple[float | None, list[np.ndarray]]:
        """Run every step. Returns the loss (if the program has one) and, if asked, copies of
        the network outputs. On any error every block of the iteration is freed."""
        prog = self.plan.program
        rt = MemoryRuntime(self.pool, prog, self.plan, self.host_pool,
                           poison_offloaded=self.debug)
        self.last_runtime = rt
        if record:
            rt.events = []
        loss_value: float | None = None
        outputs: list[np.ndarray] = []
        plan_steps = self.plan.steps
        compute = self.compute
        try:
            for a in self.plan.begin:
                rt.apply(a)
            if compute:
                for tid, x in zip(prog.inputs, feeds):
                    np.copyto(rt.array(tid), x, casting="same_kind")
            forward_done = False
            for i, ex in enumerate(self.steps):
                rt.position = i
                sp = plan_steps[i]
                if not forward_done and ex.phase in ("backward", "recompute"):
                    forward_done = True
                    rt.note_kept_for_backward()
                for a in sp.before:
                    rt.apply(a)
                if compute:
                    t0 = time.perf_counter()
                    ctx = None if ex.node < 0 else Context(
                        training=training, seed=step_seed(seed, iteration, ex.node),
                        recomputing=recomputing or ex.phase == "recompute",
                        accumulate=ex.accumulate_params)
                    if ex.phase == "encode":
                        self._encode(ex, rt)
                    elif ex.phase == "decode":
                        src = ex.attrs["source"]
                        codecs.decode(ex.attrs["codec"], rt.array(ex.inputs[0]),
                                      rt.array(ex.outputs[0]), self.codec_state.get(src, {}))
                    elif ex.phase == "recompute":
                        self._forward(ex, rt, ctx)
                    elif ex.phase == "forward":
                        self._forward(ex, rt, ctx)
                        if check_finite:
                            self._check(ex, rt)
                        if fetch_outputs:
                            outputs += [np.array(rt.array(t)) for t in ex.outputs
                                        if t in self.lowered.output_tensors]
                        if prog.loss >= 0 and ex.outputs[0] == prog.loss:
                            loss_value = float(rt.array(prog.loss))
                    else:
                        self._backward(ex, rt, ctx, loss_scale)
                    self.step_times[i] = time.perf_counter() - t0
                for a in sp.after:
                    rt.apply(a)
            rt.position = len(plan_steps)
            for a in self.plan.end:
                rt.apply(a)
        except BaseException:
            rt.release_all()
            raise
        return loss_value, outputs

    def _encode(self, ex: ExecStep, rt: MemoryRuntime) -> None:
        codec, src = ex.attrs["codec"], ex.attrs["source"]
        x = rt.array(src)
        state = self.codec_state.setdefault(src, dict(ex.attrs))
        if codec == "sparse":
            name = rt.program.tensors[src].name
            self.densities[name] = max(self.densities.get(name, 0.0), codecs.density(x))
        need = codecs.encode(codec, x, rt.array(ex.outputs[0]), state)
        if need > rt.array(ex.outputs[0]).size:
            # denser than planned: a larger block for this iteration (the plan is refined
            # from the measured densities after the first iteration)
            rt.realloc(ex.outputs[0], need)
            codecs.encode(codec, x, rt.array(ex.outputs[0]), state)

    @staticmethod
    def _forward(ex: ExecStep, rt: MemoryRuntime, ctx: Context) -> None:
        arr = rt.array
        params = {k: p.data for k, p in ex.params.items()}
        ex.layer.forward(
            ctx,
            [arr(t) for t in ex.inputs],
            [arr(t) for t in ex.outputs],
            params,
            {k: arr(t) for k, t in ex.stash.items()},
            arr(ex.workspace) if ex.workspace >= 0 else None,
        )

    @staticmethod
    def _backward(ex: ExecStep, rt: MemoryRuntime, ctx: Context, loss_scale: float = 1.0) -> None:
        arr = rt.array
        layer = ex.layer
        codec = ex.attrs.get("codec_backward")
        if codec is not None:
            g = ex.grad_inputs[0]
            if g is not None:
                dy, dx, buf = arr(ex.grad_outputs[0]), arr(g[0]), arr(ex.attrs["encoded"])
                if codec == "sign":
                    codecs.relu_backward(buf, dy, dx)
                else:
                    codecs.maxpool_backward(buf, dy, dx, ex.attrs)
                if g[1] >= 0:
                    np.add(arr(g[1]), dx, out=arr(g[1]))
            return
        g_out = []
        for t in ex.grad_outputs:
            g = arr(t)
            role = rt.program.tensors[t].role
            if role == "seed":
                g.fill(loss_scale)
            elif role == "zeros":
                g.fill(0.0)
            g_out.append(g)
        inputs = [arr(t) if j in layer.retain_inputs else None for j, t in enumerate(ex.inputs)]
        outputs = [arr(t) if j in layer.retain_outputs else None for j, t in enumerate(ex.outputs)]
        g_in = [None if g is None else arr(g[0]) for g in ex.grad_inputs]
        layer.backward(
            ctx, g_out, g_in, inputs, outputs,
            {k: p.data for k, p in ex.params.items()},
            {k: arr(ex.param_partials[k]) if k in ex.param_partials else ex.params[k].grad
             for k in ex.grad_params},
            {k: arr(t) for k, t in ex.stash.items()},
            arr(ex.workspace) if ex.workspace >= 0 else None,
        )
        for g in ex.grad_inputs:
            if g is not None and g[1] >= 0:
                target = arr(g[1])
                np.add(target, arr(g[0]), out=target)
        for k, t in ex.param_partials.items():
            grad = ex.params[k].grad
            np.add(grad, arr(t), out=grad)

    @staticmethod
    def _check(ex: ExecStep, rt: MemoryRuntime) -> None:
        for t in ex.outputs:
            a = rt.array(t)
            if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
                raise NonFiniteError(
                    f"non-finite values (NaN or inf) first appear in the output of layer "
                    f"{ex.name} ({ex.layer.describe()})"
                )
