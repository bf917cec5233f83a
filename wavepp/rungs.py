"""The ablation ladder (DESIGN §8) as named switches of one runtime. Pure: no torch.

A rung is not a mode string compared in many places: it is a small record that says
how requests are admitted, how their room is reserved, which planner sizes the waves
and which probe finds reuse. The runtime reads the switches, never the name.
"""

from __future__ import annotations

import enum

import attrs


class Admission(enum.Enum):
    INLINE = "inline"  # rank 0's LOOP admits, one request per round, on the execution path
    ROUNDS = "rounds"  # the WAVE task admits in batched rounds, off the execution path
    FREE = "free"  # rank 0 decides alone for free; decisions ride with the waves (oracle)


class Reservation(enum.Enum):
    EAGER = "eager"  # pin + allocate + evict at admission (R1, R2)
    DEFERRED = "deferred"  # lease + escrow at admission, slots just before first use


@attrs.frozen
class Rung:
    name: str
    admission: Admission
    reservation: Reservation
    planner: str  # a name in wavepp.plan.PLANNERS or "cost"
    linear_probe: bool = False  # walk block by block instead of the logarithmic probe

    @property
    def eager(self) -> bool:
        return self.reservation is Reservation.EAGER

    @property
    def look_ahead(self) -> bool:
        """Each stage does the next wave's host work (stage 0 plans it; every stage
        materializes its blocks) while this wave's executor runs. Only with admission in
        rounds: R1 keeps admission on the path by design, and the oracle's followers must
        apply rank 0's decisions in the order it made them."""
        return self.admission is Admission.ROUNDS


RUNGS: dict[str, Rung] = {
    "R1": Rung("R1", Admission.INLINE, Reservation.EAGER, "static", linear_probe=True),
    "R2": Rung("R2", Admission.ROUNDS, Reservation.EAGER, "static"),
    "R3": Rung("R3", Admission.ROUNDS, Reservation.DEFERRED, "static"),
    "R4": Rung("R4", Admission.ROUNDS, Reservation.DEFERRED, "mpu"),
    "R5": Rung("R5", Admission.ROUNDS, Reservation.DEFERRED, "cost"),
    "oracle": Rung("oracle", Admission.FREE, Reservation.DEFERRED, "mpu"),
}
