"""Weights as ``.safetensors`` files, for exchange with PyTorch and Hugging Face tooling
(needs the ``io`` extra: ``pip install 'minidl[io]'``).

A file holds a state dict (parameters and buffers; no optimizer state or training position,
which ``.npz`` checkpoints keep). Names are the network's own (``conv1.weight``,
``transformer.h.0.attn.qkv.weight``); with ``torch_names=True`` they are those of the PyTorch
twin :func:`minidl.interop.torch_bridge.to_torch` builds, so that
``twin.load_state_dict(safetensors.torch.load_file(path), strict=True)`` loads it (a tied
weight is written under each name PyTorch lists it under). :func:`load_into` reads either
naming. Arrays go through ``safetensors.numpy``, so a round trip is bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ..net.graph import Network
from ..zoo.rnn import SequenceModel
from .checkpoint import CheckpointError, atomic_path, describe_file

INSTALL_HINT = "pip install 'minidl[io]'"
#: Metadata entry saying which names a file uses: ``"minidl"`` or ``"torch"``.
NAMES_KEY = "minidl.names"


class SafetensorsError(CheckpointError):
    """A file that is not a safetensors file of this network; the message says why."""


class IncompatibleKeys(NamedTuple):
    """Names :func:`load_into` with ``strict=False`` left alone (as PyTorch's result)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _numpy_api() -> Any:
    """``safetensors.numpy``, or one error naming the extra to install."""
    try:
        import safetensors.numpy as stn
    except ImportError:
        raise ModuleNotFoundError(f"safetensors is not installed: {INSTALL_HINT}") from None
    return stn


def torch_state_names(net: Network) -> dict[str, list[str]]:
    """Each state-dict name of ``net`` -> its names in the PyTorch twin
    (:func:`~minidl.interop.torch_bridge.to_torch`): ``mods.<layer, dots as _>.<local name>``, one
    per layer using it (tied weights); the char RNNs already use PyTorch's names."""
    own = [name for name, _ in net.named_parameters(True)]
    if isinstance(net, SequenceModel):
        return {name: [name] for name in own}
    by_id = {id(p): name for name, p in net.named_parameters(True)}
    out: dict[str, list[str]] = {name: [] for name in own}
    for node in net.nodes:
        key = node.name.replace(".", "_")
        for local, p in net.layer_params(node.name).items():
            out[by_id[id(p)]].append(f"mods.{key}.{local}")
    return out


def _shown(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit
                                       else "")


def save_safetensors(net_or_state_dict: Network | Mapping[str, Any], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None,
                     torch_names: bool = False) -> None:
    """Write a network's state dict (or a ``{name: array}`` dict) to ``path`` in safetensors
    format, atomically (a temporary file renamed into place). ``metadata`` (text only) goes
    into the header with ``format: pt`` and ``minidl.names``; ``torch_names=True`` (a network
    only) writes the PyTorch twin's names."""
    stn = _numpy_api()
    path = os.fspath(path)
    if isinstance(net_or_state_dict, Network):
        state = net_or_state_dict.state_dict()
        if torch_names:
            aliases = torch_state_names(net_or_state_dict)
            state = {alias: state[name] for name, names in aliases.items() for alias in names}
    elif isinstance(net_or_state_dict, Mapping):
        if torch_names:
            raise TypeError("torch_names=True needs the network (its layers give the names), "
                            "not a state dict")
        state = dict(net_or_state_dict)
    else:
        raise TypeError(f"save_safetensors takes a Network or a dict of arrays, got "
                        f"{type(net_or_state_dict).__name__}")
    arrays: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state dict names must be strings, got {name!r}")
        a = np.asarray(value)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # 0-d stays 0-d
        if a.dtype.kind not in "biuf":
            raise TypeError(f"{name}: dtype {a.dtype} cannot be stored in safetensors "
                            "(valid: bool, integer and floating arrays)")
        arrays[name] = a
    header = {"format": "pt", NAMES_KEY: "torch" if torch_names else "minidl"}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"metadata is text only: {key!r}: {value!r} is not str: str")
        header[key] = value
    with atomic_path(path, ".safetensors") as tmp:
        stn.save_file(arrays, tmp, metadata=header)


def _describe(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        return ("a zip / .npz file (a minidl checkpoint from minidl train --save FILE.npz "
                "continues with --resume)")
    return describe_file(path)


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file by name, as written (any naming). Raises
    :class:`SafetensorsError` saying what the file is when it is not one."""
    stn = _numpy_api()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"safetensors file {path} does not exist"
                                + (" (it is a folder)" if os.path.isdir(path) else ""))
    try:
        return stn.load_file(path)
    except TypeError as e:  # a dtype NumPy has no type for (bfloat16, float8)
        raise SafetensorsError(f"{path} holds tensors NumPy cannot read ({e}); convert them "
                               "to float32 first") from None
    except Exception as e:  # safetensors' own error type is not part of its public API
        raise SafetensorsError(f"{path} is {_describe(path)}, not a safetensors file "
                               f"({e})") from None


def _own_names(net: Network, state: Mapping[str, np.ndarray], path: str
               ) -> dict[str, np.ndarray]:
    """``state`` with the PyTorch twin's names mapped to ``net``'s (a file of its own names
    unchanged); the copies of a tied weight must agree bit for bit."""
    alias = {t: own for own, ts in torch_state_names(net).items() for t in ts}
    own = {name for name, _ in net.named_parameters(True)}
    if all(k in own for k in state) or not any(k in alias and k not in own for k in state):
        return dict(state)
    out: dict[str, np.ndarray] = {}
    first: dict[str, str] = {}
    for key, value in state.items():
        name = alias.get(key, key)
        if name in out:
            same = (out[name].shape == value.shape and out[name].dtype == value.dtype
                    and out[name].tobytes() == value.tobytes())
            if not same:
                raise SafetensorsError(f"{path}: {first[name]} and {key} are one tied weight "
                                       f"({name}) of {net.name} but differ in the file")
            continue
        out[name], first[name] = value, key
    return out


def load_into(net: Network, path: str | os.PathLike, strict: bool = True) -> IncompatibleKeys:
    """Load a safetensors file (``net``'s names or its PyTorch twin's) into ``net``'s
    parameters and buffers in place. Every name, shape and dtype kind is checked before
    anything is copied; ``strict=True`` refuses missing and unexpected names, ``strict=False``
    loads the names both have and returns the others. Raises :class:`SafetensorsError`
    naming the key and shapes."""
    path = os.fspath(path)
    state = _own_names(net, load_safetensors(path), path)
    own = dict(net.named_parameters(True))
    missing = [k for k in own if k not in state]
    unexpected = sorted(k for k in state if k not in own)
    if strict and (missing or unexpected):
        parts = [f"missing {_shown(missing)}" if missing else "",
                 f"unexpected {_shown(unexpected)}" if unexpected else ""]
        raise SafetensorsError(f"{path} does not match {net.name}: "
                               + "; ".join(p for p in parts if p))
    for name, value in state.items():
        if name not in own:
            continue
        if tuple(value.shape) != own[name].shape:
            raise SafetensorsError(f"{path}: {name} has shape {tuple(value.shape)} in the "
                                   f"file, {own[name].shape} in {net.name}")
        if not np.can_cast(value.dtype, own[name].dtype, "same_kind"):
            raise SafetensorsError(f"{path}: {name} is {value.dtype} in the file, "
                                   f"{own[name].dtype} in {net.name}")
    net.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    return IncompatibleKeys(missing, unexpected)
