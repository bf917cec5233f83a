"""Pure chunk planners (DESIGN §5). No torch, no I/O."""

from wavepp.plan.cost import CostFit, CostModel, cost_plan, observe
from wavepp.plan.planners import (
    PLANNERS,
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

__all__ = [
    "PLANNERS",
    "Chunk",
    "CostFit",
    "CostModel",
    "Pending",
    "PlanContext",
    "Planner",
    "Wave",
    "cost_plan",
    "estimated_waves",
    "fill",
    "mpu",
    "mpu_budget",
    "observe",
    "parse_wave",
    "static",
]
