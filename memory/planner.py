"""From a program and a memory spec to a plan: each flag's module rewrites the plan in turn."""

from __future__ import annotations

from .config import MemoryConfig
from .network_wide import network_wide_plan
from .plan import Plan
from .program import Program


def make_plan(program: Program, config: MemoryConfig) -> Plan:
    """The plan for ``program`` under ``config`` (a pure function of both)."""
    plan = network_wide_plan(program)
    plan.spec = config.spec
    return plan
