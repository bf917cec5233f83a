"""The admission protocol's invariants (DESIGN §4) for the default policy.

The state machine itself lives in :mod:`wavepp.checker.machines`, so that
``python -m wavepp.checker pkg.mod:NAME`` runs the same checks against anyone's policy.
"""

from hypothesis import HealthCheck, settings

from wavepp.checker import admission_machine
from wavepp.policy import DEFAULT

AdmissionMachine = admission_machine(DEFAULT)
AdmissionMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAdmission = AdmissionMachine.TestCase
