"""Pure chunk planners (DESIGN §5). No torch, no I/O."""

from wavepp.plan.planners import (
    PLANNERS,
    PlanContext,
    Planner,
    Pending,
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
    "PlanContext",
    "Pending",
    "Planner",
    "Wave",
    "estimated_waves",
    "fill",
    "mpu",
    "mpu_budget",
    "parse_wave",
    "static",
]
