"""The default policy, with a materialize that records each call: one line with the
calling rank (torchrun's ``RANK``) appended to the file ``$WAVEPP_COUNT_FILE`` names.

It shows that a policy given with ``--policy`` is the one every rank calls:
``WAVEPP_COUNT_FILE=calls.txt torchrun --nproc-per-node 4 -m wavepp.main --executor sim
--policy examples.policies.counting:POLICY`` leaves lines from ranks 0..3. Without the
variable it records nothing (and checks like the default).
"""

import os

import attrs

from wavepp import state
from wavepp.policy import DEFAULT


def counting_materialize(cache, request_id, num_blocks=None):
    path = os.environ.get("WAVEPP_COUNT_FILE")
    if path:
        with open(path, "a") as out:
            out.write(f"{os.environ.get('RANK', '?')}\n")
    return state.materialize(cache, request_id, num_blocks)


POLICY = attrs.evolve(DEFAULT, name="counting", materialize=counting_materialize)
