"""Pure chunk planners (DESIGN §5). No torch, no I/O."""

from wavepp.plan.cost import CostFit, CostModel, NoCostModel, cost, cost_plan, observe
from wavepp.plan.planners import (
    PLANNERS as _BASE_PLANNERS,
)
from wavepp.plan.planners import (
    Pending,
    PlanContext,
    Planner,
    estimated_waves,
    fill,
    mpu,
    mpu_budget,
    static,
)
from wavepp.plan.wave import Chunk, Wave, parse_wave

PLANNERS: dict[str, Planner] = {**_BASE_PLANNERS, "cost": cost}
"""The built-in planners by name: ``static``, ``mpu`` and ``cost`` (the online fit)."""

__all__ = [
    "PLANNERS",
    "Chunk",
    "CostFit",
    "CostModel",
    "NoCostModel",
    "Pending",
    "PlanContext",
    "Planner",
    "Wave",
    "cost",
    "cost_plan",
    "estimated_waves",
    "fill",
    "mpu",
    "mpu_budget",
    "observe",
    "parse_wave",
    "static",
]
