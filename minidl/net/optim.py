"""Optimizers, learning-rate schedules and gradient clipping.

Optimizer state (SGD's momentum buffer, Adam's moments: exactly PyTorch's state, nothing
else) lives wherever the trainer puts it:
:meth:`Optimizer.init_state` takes an allocator ``alloc(name, shape, dtype) -> zeroed array``
(e.g. views into the device pool); :meth:`Optimizer.state_spec` lists what it will ask for, so
a planner can count the bytes before anything is allocated. Without ``init_state`` the first
:meth:`Optimizer.step` allocates with ``np.zeros``.

Updates follow PyTorch's single-tensor (CPU) formulas in the same order of operations, with
scalars cast to the parameter's dtype as PyTorch does; results agree with ``torch.optim`` to
float32 rounding (PyTorch's fused multiply-adds can differ in the last bit). Each parameter is
updated in place by one fused kernel of :mod:`minidl.kernels.pointwise.optim`:

- NumPy arrays (C-contiguous, float32 or float64): a Numba loop, one pass over memory, no
  temporaries, nothing allocated per step; bit-identical to the ufunc reference.
- Anything else (CuPy arrays of the ``cuda`` device, non-contiguous or other-dtype arrays): the
  NumPy-ufunc reference, whose temporaries (at most two of the parameter's size, freed at the
  end of that parameter's update) are allocated by the array library itself; for CuPy that is
  CuPy's allocator, which the ``cuda`` device routes into its pool. They are transient, not
  optimizer state, and are not in :meth:`Optimizer.state_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from minidl.net.parameter import Parameter

from ..kernels.array_api import namespace
from ..kernels.pointwise.optim import adam_update, sgd_update
from ..memory.runtime.transfer import copy_into, to_host
from .graph import listed_names

Alloc = Callable[[str, tuple[int, ...], np.dtype], Any]
StateSpec = list[tuple[str, tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class FlatGroup:
    """Parameters laid out back to back in one memory range, their gradients and each state
    slot likewise in ranges of the same layout (what the trainer's engine allocates): one
    update over the flat arrays is every parameter's update, in one pass (on a GPU, one
    kernel launch). The bytes between parameters (alignment) are zeros and stay zeros.

    ``data`` / ``grad`` / ``slots[slot]`` are flat views of the whole ranges; the group
    applies while each parameter's ``data`` and ``grad`` are still the views it was made with.
    """

    params: tuple[Parameter, ...]
    data: Any
    grad: Any
    slots: dict[str, Any]
    views: tuple[tuple[Any, Any], ...]  # (data, grad) of each parameter when grouped

    def applies(self) -> bool:
        return all(p.data is d and p.grad is g for p, (d, g) in zip(self.params, self.views))


def _zeros(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


def _check_nonneg(**values: float) -> None:
    for key, value in values.items():
        if not value >= 0.0:  # also rejects NaN
            raise ValueError(f"invalid {key}: {value} (must be >= 0)")


class Optimizer:
    """Base class: keeps the trainable parameters, their state, the step count and ``lr``.

    Subclasses declare ``slots`` (per-parameter state arrays, named ``f"{param.name}.{slot}"``)
    and ``_update(p, slots, step)``.
    """

    slots: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Parameter], lr: float) -> None:
        unique: dict[int, Parameter] = {}
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError(f"optimizer params must be Parameters, got {type(p).__name__}")
            if p.trainable:
                unique.setdefault(id(p), p)
        self.params: list[Parameter] = list(unique.values())
        names = [p.name for p in self.params]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"parameter names must be unique, repeated: {', '.join(dupes)}")
        self.lr = lr
        self.step_count = 0
        self.param_steps: dict[str, int] = {p.name: 0 for p in self.params}
        self._state: dict[str, Any] | None = None
        #: Groups updated in one pass each (set by the trainer: :class:`FlatGroup`).
        self.flat_groups: list[FlatGroup] = []

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        _check_nonneg(lr=value)
        self._lr = float(value)

    # ----------------------------------------------------------------- state

    def state_spec(self) -> StateSpec:
        """``(name, shape, dtype)`` of every array :meth:`init_state` will allocate: one per
        parameter and slot, nothing else (the updates need no scratch); slot by slot, each in
        the parameters' order (so an allocator placing them in turn lays each slot out as the
        parameters are: see :class:`FlatGroup`)."""
        return [(f"{p.name}.{slot}", p.shape, p.dtype) for slot in self.slots for p in self.params]

    def state_bytes(self) -> int:
        """Total bytes of optimizer state (allocated or not yet)."""
        return sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype in self.state_spec())

    def init_state(self, alloc: Alloc) -> None:
        """Allocate all state through ``alloc(name, shape, dtype)``, which returns zeroed arrays.

        Calling it again moves existing state into the new arrays (values are kept).
        """
        new: dict[str, Any] = {}
        for name, shape, dtype in self.state_spec():
            arr = alloc(name, shape, dtype)
            if tuple(arr.shape) != tuple(shape) or np.dtype(arr.dtype) != dtype:
                raise ValueError(f"alloc({name!r}) returned {tuple(arr.shape)} {arr.dtype}, "
                                 f"expected {tuple(shape)} {dtype}")
            if self._state is not None:
                copy_into(arr, self._state[name])
            new[name] = arr
        self._state = new

    @property
    def state(self) -> dict[str, Any]:
        """Name -> state array (allocated with ``np.zeros`` on first access if needed)."""
        if self._state is None:
            self.init_state(_zeros)
        assert self._state is not None
        return self._state

    def state_dict(self) -> dict[str, Any]:
        """Host copies of the state: ``step``, ``lr``, ``{param}.step`` and state arrays."""
        d: dict[str, Any] = {"step": self.step_count, "lr": self.lr}
        for p in self.params:
            d[f"{p.name}.step"] = self.param_steps[p.name]
            for slot in self.slots:
                d[f"{p.name}.{slot}"] = to_host(self.state[f"{p.name}.{slot}"])
        return d

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Copy a :meth:`state_dict` into the existing state arrays (keys and shapes checked)."""
        expected = set(self.state_dict_keys())
        missing, unexpected = expected - set(d), set(d) - expected
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {listed_names(sorted(missing))}, "
                           f"unexpected {listed_names(sorted(unexpected))}")
        for p in self.params:
            for slot in self.slots:
                key = f"{p.name}.{slot}"
                if tuple(np.shape(d[key])) != p.shape:
                    raise ValueError(f"state {key!r} has shape {tuple(np.shape(d[key]))}, "
                                     f"expected {p.shape}")
        for p in self.params:
            for slot in self.slots:
                key = f"{p.name}.{slot}"
                copy_into(self.state[key], np.asarray(d[key], dtype=p.dtype))
            self.param_steps[p.name] = int(d[f"{p.name}.step"])
        self.step_count = int(d["step"])
        self.lr = float(d["lr"])

    def state_dict_keys(self) -> list[str]:
        keys = ["step", "lr"]
        for p in self.params:
            keys += [f"{p.name}.step"] + [f"{p.name}.{slot}" for slot in self.slots]
        return keys

    # ----------------------------------------------------------------- stepping

    def zero_grad(self) -> None:
        """Fill every existing gradient with zeros (in place)."""
        for p in self.params:
            if p.grad is not None:
                p.grad[...] = 0

    def step(self) -> None:
        """Update every parameter that has a gradient, in place (a :class:`FlatGroup` whose
        parameters all have their gradient and one step count in one pass)."""
        state = self.state
        self.step_count += 1
        grouped: set[int] = set()
        for group in self.flat_groups:
            steps = {self.param_steps[p.name] for p in group.params}
            if len(steps) != 1 or not group.applies():
                continue
            for p in group.params:
                self.param_steps[p.name] += 1
                grouped.add(id(p))
            self._update_flat(group, steps.pop() + 1)
        for p in self.params:
            if p.grad is None or id(p) in grouped:
                continue
            self.param_steps[p.name] += 1
            slots = [state[f"{p.name}.{slot}"] for slot in self.slots]
            self._update(p, slots, self.param_steps[p.name])

    def _update_flat(self, group: FlatGroup, step: int) -> None:
        """Update a whole group: its flat arrays as one parameter (the updates are
        elementwise, so the bits are the parameters' own updates)."""
        self._update(_FlatParameter(group.data, group.grad), [group.slots[s] for s in self.slots],
                     step)

    def _update(self, p: Parameter, slots: list[Any], step: int) -> None:
        """Update ``p.data`` in place from ``p.grad`` and its state ``slots``; ``step`` is the
        parameter's own step count, 1 on its first update."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(lr={self.lr}, params={len(self.params)})"


class _FlatParameter:
    """A group's flat arrays as the ``p`` of :meth:`Optimizer._update` (``.data``, ``.grad``)."""

    __slots__ = ("data", "grad")

    def __init__(self, data: Any, grad: Any) -> None:
        self.data, self.grad = data, grad


class SGD(Optimizer):
    """SGD with optional momentum, dampening, L2 weight decay and Nesterov (as torch.optim.SGD).

    State: ``{name}.momentum`` per parameter when ``momentum > 0``.
    """

    def __init__(self, params: Iterable[Parameter], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        _check_nonneg(momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)
        self.slots = ("momentum",) if momentum != 0 else ()
        super().__init__(params, lr)

    def _update(self, p: Parameter, slots: list[Any], step: int) -> None:
        sgd_update(p.data, p.grad, slots[0] if slots else None, self.lr, self.momentum,
                   self.dampening, self.weight_decay, self.nesterov, first_step=step == 1)


class Adam(Optimizer):
    """Adam (Kingma & Ba) as torch.optim.Adam: ``weight_decay`` is L2 added to the gradient.

    State: ``{name}.exp_avg`` and ``{name}.exp_avg_sq`` per parameter; bias correction uses
    each parameter's own step count.
    """

    slots = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        _check_nonneg(eps=eps, weight_decay=weight_decay)
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"invalid beta parameter at index {i}: {beta}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        super().__init__(params, lr)

    def _update(self, p: Parameter, slots: list[Any], step: int) -> None:
        m, v = slots
        adam_update(p.data, p.grad, m, v, self.lr, self.betas[0], self.betas[1], self.eps,
                    self.weight_decay, step, self.decoupled)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW."""

    decoupled = True

    def __init__(self, params: Iterable[Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


# --------------------------------------------------------------------------- gradient clipping


def clip_grad_norm_(params: Iterable[Parameter], max_norm: float) -> Any:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the total norm before clipping. As in PyTorch, grads are multiplied by
    ``max_norm / (total_norm + 1e-6)`` when that is below 1. A NaN or infinite total norm is
    returned as is and nothing is scaled: the caller decides (the trainer raises).

    The norm is the square root of the float64 sum of each gradient's ``dot(g, g)``. On a
    device (CuPy arrays) everything stays there: the norm is a 0-d device array, the scale
    ``min(1, max_norm / (norm + 1e-6))`` is applied whatever it is (times 1.0 changes no bit),
    and the host never waits for the device (a non-finite norm then scales the gradients to
    NaN: read the returned norm to check it).
    """
    _check_nonneg(max_norm=max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    xp = namespace(grads[0])
    squares = xp.empty(len(grads), np.float64)
    for i, g in enumerate(grads):
        flat = g.reshape(-1)
        squares[i:i + 1].reshape(())[...] = np.dot(flat, flat)
    total = np.sqrt(squares.sum())
    if xp is np:
        return scale_to_norm(grads, float(total), max_norm)
    coef = np.minimum(max_norm / (total + 1e-6), 1.0)
    for g in grads:  # (one cast per dtype would do; gradients share one)
        np.multiply(g, coef.astype(g.dtype), out=g)
    return total


def scale_to_norm(grads: list, total_norm: float, max_norm: float) -> float:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1
    (PyTorch's rule; a non-finite norm leaves them as they are); returns ``total_norm``."""
    if not math.isfinite(total_norm):
        return total_norm
    clip_coef = max_norm / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for g in grads:
            np.multiply(g, g.dtype.type(clip_coef), out=g)
    return total_norm


# --------------------------------------------------------------------------- schedules


class LRScheduler:
    """Sets ``optimizer.lr`` from a closed-form schedule of the step counter ``last_epoch``.

    Call :meth:`step` once per epoch or once per iteration, as you mean ``t``; construction sets
    the lr for ``t = 0``. ``warmup_steps = w > 0`` multiplies the schedule by
    ``min(1, (t + 1) / (w + 1))``: a linear ramp from ``lr / (w + 1)`` reaching the schedule's
    value at ``t = w``.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self.warmup_steps = int(warmup_steps)
        self.last_epoch = 0
        self.optimizer.lr = self.lr_at(0)

    def schedule_lr(self, t: int) -> float:
        """The schedule's lr at step ``t``, before warmup."""
        raise NotImplementedError

    def lr_at(self, t: int) -> float:
        """The lr at step ``t``, warmup included."""
        lr = self.schedule_lr(t)
        if t < self.warmup_steps:
            lr *= (t + 1) / (self.warmup_steps + 1)
        return lr

    def step(self) -> None:
        self.last_epoch += 1
        self.optimizer.lr = self.lr_at(self.last_epoch)

    def get_last_lr(self) -> float:
        return self.optimizer.lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lr": self.base_lr}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.last_epoch, self.base_lr = int(d["last_epoch"]), float(d["base_lr"])
        self.optimizer.lr = self.lr_at(self.last_epoch)


class LambdaLR(LRScheduler):
    """``lr = base_lr * lr_lambda(t)`` (with optional warmup)."""

    def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float],
                 warmup_steps: int = 0) -> None:
        self.lr_lambda = lr_lambda
        super().__init__(optimizer, warmup_steps)

    def schedule_lr(self, t: int) -> float:
        return self.base_lr * float(self.lr_lambda(t))


class StepLR(LRScheduler):
    """``lr = base_lr * gamma ** (t // step_size)``."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1,
                 warmup_steps: int = 0) -> None:
        if step_size < 1:
            raise ValueError(f"step_size must be >= 1, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, warmup_steps)

    def schedule_lr(self, t: int) -> float:
        return self.base_lr * self.gamma ** (t // self.step_size)


class CosineAnnealingLR(LRScheduler):
    """``lr = eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2`` (periodic past
    ``T_max``, like PyTorch's)."""

    def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0,
                 warmup_steps: int = 0) -> None:
        if T_max < 1:
            raise ValueError(f"T_max must be >= 1, got {T_max}")
        self.T_max, self.eta_min = int(T_max), float(eta_min)
        super().__init__(optimizer, warmup_steps)

    def schedule_lr(self, t: int) -> float:
        cos = (1 + math.cos(math.pi * t / self.T_max)) / 2
        return self.eta_min + (self.base_lr - self.eta_min) * cos


def make_optimizer(name: str, params: list, lr: float | None = None,
                   weight_decay: float = 0.0) -> Optimizer:
    """An optimizer by CLI name: ``sgd`` (momentum 0.9, default lr 0.05), ``adam`` and
    ``adamw`` (default lr 1e-3)."""
    name = name.lower()
    if name == "sgd":
        return SGD(params, lr=0.05 if lr is None else lr, momentum=0.9,
                   weight_decay=weight_decay)
    if name == "adam":
        return Adam(params, lr=1e-3 if lr is None else lr, weight_decay=weight_decay)
    if name == "adamw":
        return AdamW(params, lr=1e-3 if lr is None else lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; valid: sgd, adam, adamw")


class OptimizerWrapper:
    """An optimizer that wraps another one (``inner``) and changes what a step does; the
    state, learning rate and checkpoints are the inner optimizer's."""

    def __init__(self, inner: Optimizer) -> None:
        self.inner = inner

    @property
    def params(self) -> list[Parameter]:
        return self.inner.params

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    def state_spec(self) -> StateSpec:
        return self.inner.state_spec()

    def state_bytes(self) -> int:
        return self.inner.state_bytes()

    def init_state(self, alloc: Alloc) -> None:
        self.inner.init_state(alloc)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()
