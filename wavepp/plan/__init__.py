"""Pure chunk planners (DESIGN §5). No torch, no I/O."""

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
    "Pending",
    "PlanContext",
    "Planner",
    "Wave",
    "estimated_waves",
    "fill",
    "mpu",
    "mpu_budget",
    "parse_wave",
    "static",
]
