"""A compiled step: one program lowered for a set of shapes, its memory plan and its executor."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory.ir.plan import Plan
from .executor import Executor
from .lowering import Lowered


@dataclass
class Compiled:
    lowered: Lowered
    plan: Plan
    executor: Executor
    notes: list[str] = field(default_factory=list)  # choices made before planning
