"""The protocol's invariants as a checker for any policy (``python -m wavepp.checker``).

The Hypothesis state machine of the admission protocol and the planner property live
here, not in ``tests/``, so an installed package can check a researcher's policy; the
test suite runs the same machines against the default policy. Needs ``hypothesis``.
No torch.
"""

from wavepp.checker.check import Finding, Report, check_policy
from wavepp.checker.invariants import INVARIANTS, Violation
from wavepp.checker.machines import admission_machine
from wavepp.checker.planners import planner_property

__all__ = [
    "INVARIANTS",
    "Finding",
    "Report",
    "Violation",
    "admission_machine",
    "check_policy",
    "planner_property",
]
