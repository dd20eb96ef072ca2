"""Options grouped by what they set, taken as flat keywords too: an entry point's options
object (:class:`~minidl.train.setup.trainer_options.TrainerOptions`,
:class:`~minidl.analysis.dry_run_options.DryRunOptions`) is a frozen dataclass whose fields
are frozen dataclasses (the groups), and each keyword names a field of one group. Here, the
lowest package both entry points read."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

__all__ = ["field_names", "with_keywords"]

T = TypeVar("T")


def with_keywords(options: T, keywords: dict[str, Any]) -> tuple[T, dict[str, Any]]:
    """``options`` with each keyword that names a field of one of its groups set there, and
    the keywords no group has (the caller says how an unknown one is refused)."""
    left = dict(keywords)
    groups = {}
    for f in fields(options):
        group = getattr(options, f.name)
        mine = {g.name: left.pop(g.name) for g in fields(group) if g.name in left}
        groups[f.name] = replace(group, **mine) if mine else group
    return replace(options, **groups), left


def field_names(options: Any) -> list[str]:
    """Every keyword :func:`with_keywords` sets on ``options``, sorted."""
    return sorted(g.name for f in fields(options) for g in fields(getattr(options, f.name)))
