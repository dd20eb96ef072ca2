"""What a device can do, read in one place: its declared traits and optional GPU hooks.

Every device states ``name``, ``kind``, ``has_storage`` and ``asynchronous``; a GPU-like
device (:class:`~.device.GpuDevice`) adds the hooks ``activate``, ``route_allocations``,
``step_timer``, ``copy_from_host`` and ``fetch_async``. Callers read them through
:func:`device_traits`, so a device that leaves one out gets the same default everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..ir.names import DeviceKind


@dataclass(frozen=True)
class DeviceTraits:
    """One device's traits, defaults filled in."""

    name: str
    #: What programs are lowered for: workspaces and kernels differ.
    kind: DeviceKind = DeviceKind.CPU
    #: False for a device that only counts bytes (the meta device of dry runs).
    has_storage: bool = True
    #: True where compute returns before it finishes (a GPU stream): steps are timed by the
    #: device's events and the host need not wait.
    asynchronous: bool = False
    #: Makes the device current for a block (``with traits.activate(): ...``).
    activate: Callable[[], AbstractContextManager] = contextlib.nullcontext
    #: ``route_allocations(allocate)``: a context in which the array library allocates
    #: its temporaries through ``allocate`` (None: it allocates on its own).
    route_allocations: Callable[..., AbstractContextManager] | None = None
    #: ``step_timer(num_steps)``: a timer of steps on the device's own clock (None: host clock).
    step_timer: Callable[[int], Any] | None = None
    #: ``copy_from_host(dst, src)``: upload a host array into a device array (None: ``dst[...]
    #: = src``).
    copy_from_host: Callable[[Any, Any], None] | None = None
    #: ``fetch_async(src)``: start a device-to-host copy and return its pending result (None:
    #: read synchronously).
    fetch_async: Callable[[Any], Any] | None = None


def device_traits(device: Any) -> DeviceTraits:
    """The traits of ``device`` (any object; what it does not declare takes the defaults)."""
    defaults = DeviceTraits(name=type(device).__name__)
    values = {f: getattr(device, f, getattr(defaults, f)) for f in
              ("name", "kind", "has_storage", "asynchronous", "activate", "route_allocations",
               "step_timer", "copy_from_host", "fetch_async")}
    values["kind"] = DeviceKind.of(values["kind"])
    values["has_storage"] = bool(values["has_storage"])
    values["asynchronous"] = bool(values["asynchronous"])
    return DeviceTraits(**values)
